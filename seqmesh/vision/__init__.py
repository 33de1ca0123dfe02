"""Vision-language models under sequence parallelism: the vision tower sharded by patches like tokens.

- ``families``: the models seqmesh runs exactly (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE), LLaVA) and the
  refusals by name.
- ``grid``: where every patch sits, from the media grids alone (frames, windows, positions).
- ``batch``: a whole multimodal batch to this rank's tokens, M-RoPE ids, patches and routing plan.
- ``plain``: LLaVA's CLIP tower (a class token, learned positions, no merging): its share and its run.
- ``route``: which tower outputs each rank sends where, computed from the batch on every rank.
- ``tower``: the Qwen-VL towers on this rank's patches, and ``VisionLanguageLM``.
"""
