"""Vision-language models under sequence parallelism: the vision tower sharded by patches like tokens.

- ``families``: the models seqmesh runs exactly (Qwen2.5-VL, Qwen3-VL) and the refusals by name.
- ``grid``: where every patch sits, from the media grids alone (frames, windows, positions).
- ``batch``: a whole multimodal batch to this rank's tokens, M-RoPE ids, patches and routing plan.
- ``tower``: the tower on this rank's patches, the route of its embeddings, ``VisionLanguageLM``.
"""
