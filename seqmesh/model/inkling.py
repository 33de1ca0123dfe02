"""Inkling (``inkling_text``) as the planner sizes it, read from a transformers ``config.json`` (``seqmesh.hf.inkling``
runs it). The multimodal file's towers are not sized: the planner refuses it by name, and its ``text_config`` written
as a file of its own plans the language model.

Each layer is attention with a relative bias, then an MLP (``mlp_layer_types``: experts, or dense for the first
``dense_mlp_idx``), each followed by a short convolution and added to the residual stream behind an RMSNorm. A layer
is ``hybrid_sliding`` (a window of ``sliding_window_size``, its own ``swa_*`` heads) or ``hybrid`` (full, the file's
heads; its bias reaches ``rel_extent`` keys back). An attention layer of ``H`` query and ``Hkv`` key heads of ``D``
holds::

    q_proj E x H D, k_proj and v_proj E x Hkv D, r_proj E x H d_rel, o_proj H D x E, q_norm and k_norm D,
    a depthwise conv (kernel K, float32) on the keys and one on the values, rel_logits_proj d_rel x extent

(``extent`` the window on a sliding layer); a layer besides two norms, two depthwise convs of ``E`` channels (after
the attention and after the MLP), and its MLP: a gated MLP and a scale, or ``n_routed_experts`` gated experts with
``n_shared_experts`` shared ones of ``moe_intermediate_size`` and a router of a row an expert, shared ones included,
and a scale. The model: an embedding with an RMSNorm, the final norm, the head.

Inkling 2 (``inkling2_text``; ``inkling2``'s multimodal file is refused by name, as Inkling's) has the same two kinds
and relative bias, and differs in each part:

- its attention: a learned per-head scale before each query's clip (``H x D``; the full layers' log-scaled), keys
  and values of their own ``E x Hkv D`` projections followed by a short convolution, ``o_proj`` a gate (``E x H D``)
  beside its output projection, a sink logit per head (``sink_proj`` ``E x H``), the bias's relative states scaled
  per head (``H x d_rel``) before their clip. A sliding layer's convolutions are static (``Hkv D x K``); a full
  layer's dynamic, static taps (``K x Hkv D``) plus per-token taps projected from its input (``E x Hkv K``);
- its layer: depth attention (learned queries of ``E``: one before the MLP, and before the attention one in a sliding
  layer, three in a full one, none in the first layer) over the block states each token keeps, one a block of
  ``n_layers_per_attn_res_block`` layers; norms (a full layer's attention has three: its queries', keys' and
  values' inputs); two short convolutions of ``E`` channels; experts with a float32 router of a row each, no shared
  experts and no scale;
- the model: the embedding's norm, a last depth attention before the final norm, a head of ``unpadded_vocab_size``
  rows.

Inkling2-Loop (``inkling2_loop_text``) is Inkling 2 whose layers ``loop_layer_index_start .. loop_layer_index_end - 1``
run ``loop_num_passes`` times: each pass after the first starts again from the states before the loop and mixes into
each looped layer's inputs (its queries', keys', values' and MLP's) a message the model's depth attention reads from
the previous pass's block states (learned queries ``looped x 4 x E``), through four message gates a looped layer
(each ``2E x r`` down, ``r x E`` forget and message projections of ``loop_gate_rank`` ``r``).
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("inkling", "inkling_text")
SECOND = ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text")  # Inkling 2 and Inkling2-Loop
LOOP = ("inkling2_loop", "inkling2_loop_text")
SLIDING, FULL = "hybrid_sliding", "hybrid"


@dataclass(frozen=True)
class InklingShape:
    """Inkling's sizes beyond the common ones (module docstring); the full layers' heads are the model's."""

    kinds: tuple[str, ...]  # each layer's: SLIDING or FULL
    sliding_heads: int
    sliding_kv_heads: int
    sliding_head_dim: int
    window: int
    rel_extent: int
    d_rel: int
    kernel: int  # K of every short convolution
    log_scaling: bool = False  # the full layers scale each query and its bias by the log of its index (in float32)
    block_layers: int = 0  # Inkling 2: the layers of one block of the states each token keeps; 0: Inkling
    head_vocab: int = 0  # Inkling 2: the head's rows (``unpadded_vocab_size``); 0: the embedding's
    planned_layer: int = -1  # Inkling 2: the layer whose stacks of block states a kind is planned at; -1: its last
    loop_start: int = 0  # Inkling2-Loop: its looped layers loop_start .. loop_end - 1, run ``passes`` times
    loop_end: int = 0
    passes: int = 1
    gate_rank: int = 0  # Inkling2-Loop: its message gates' rank (0: Inkling 2, none)

    def count(self, kind: str) -> int:
        return self.kinds.count(kind)

    def heads(self, kind: str, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """(H, Hkv, D) of a layer of ``kind``, given the full layers' (the model's)."""
        if kind == SLIDING:
            return self.sliding_heads, self.sliding_kv_heads, self.sliding_head_dim
        return heads, kv_heads, head_dim

    def extent(self, kind: str) -> int:
        """Distances the bias reaches: the window on a sliding layer, ``rel_extent`` on a full one."""
        return self.window if kind == SLIDING else self.rel_extent

    @property
    def second(self) -> bool:
        """Whether this is Inkling 2 (module docstring)."""
        return self.block_layers > 0

    def attention_params(self, kind: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
        """One attention of ``kind`` (module docstring)."""
        h, hk, d = self.heads(kind, heads, kv_heads, head_dim)
        if not self.second:
            return (hidden * d * (2 * h + 2 * hk) + hidden * h * self.d_rel + 2 * hk * d * self.kernel + 2 * d
                    + self.d_rel * self.extent(kind))
        convs = 2 * hk * d * self.kernel if kind == SLIDING else 2 * self.kernel * (hk * d + hidden * hk)
        return (hidden * d * (3 * h + 2 * hk) + h * d + convs + hidden * h + (hidden + 1) * h * self.d_rel
                + self.d_rel * self.extent(kind))

    def layer_params(self, kind: str, hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int,
                     first: bool = False, looped: bool = False) -> int:
        """One layer of ``kind`` with an MLP of ``mlp`` parameters: its attention, two norms and two convs; Inkling
        2's depth attention's queries (fewer in the ``first`` layer) and its full layers' two norms more; a
        ``looped`` layer's four message gates."""
        own = self.attention_params(kind, hidden, heads, kv_heads, head_dim) + 2 * hidden * (1 + self.kernel) + mlp
        if not self.second:
            return own
        queries = 1 + (0 if first else self.depth_queries(kind))
        gates = 4 * 4 * hidden * self.gate_rank if looped else 0
        return own + hidden * (queries + (2 if kind == FULL else 0)) + gates

    def looped(self, index: int) -> bool:
        """Inkling2-Loop: whether layer ``index`` is one of the looped layers (with message gates)."""
        return self.gate_rank > 0 and self.loop_start <= index < self.loop_end

    @property
    def extra_passes(self) -> int:
        """Inkling2-Loop: the layer calls its passes after the first add to a step's (0: Inkling 2)."""
        looped = len(range(self.loop_start, min(self.loop_end, len(self.kinds))))
        return (self.passes - 1) * looped if self.gate_rank else 0

    def depth_queries(self, kind: str) -> int:
        """Inkling 2: the learned queries of the depth attention before a layer's attention (its input's, or its
        queries', keys' and values' inputs)."""
        return 3 if kind == FULL else 1

    def blocks(self, layers: int) -> int:
        """Inkling 2: block states a token keeps at the last layer (one a block begun before it)."""
        return self.entries(layers - 1)

    def entries(self, index: int) -> int:
        """Inkling 2: the block states layer ``index``'s input carries, one a block begun before it (``layers``:
        the final depth attention's)."""
        return -(-index // self.block_layers) if self.second else 0

    def stacks(self, kind: str, gated: bool = False) -> tuple[int, int]:
        """Inkling 2: the states each of a layer's two depth attentions stacks (its block states and the partial
        one; before the MLP, at a block's first layer, the layer's input too), at :attr:`planned_layer`, or at
        the last layer of ``kind`` (``gated``: the last looped one, a pass after the first restarting from the
        states before the loop); before the first layer's attention none (0)."""
        looped = range(self.loop_start, self.loop_end) if gated else range(len(self.kinds))
        index = self.planned_layer if self.planned_layer >= 0 else max(i for i in looped if self.kinds[i] == kind)
        n = self.entries(index)
        return (n + 1 if index else 0), n + 1 + (index % self.block_layers == 0)

    def gated_calls(self, kind: str) -> int:
        """Inkling2-Loop: the calls of looped layers of ``kind`` with messages (every pass after the first)."""
        return (self.passes - 1) * self.kinds[self.loop_start:self.loop_end].count(kind) if self.gate_rank else 0

    @property
    def message_stack(self) -> int:
        """Inkling2-Loop: the states the message depth attention stacks (the block states the previous pass
        appended after its first, and its last output)."""
        return self.entries(self.loop_end) - self.entries(self.loop_start)

    def boundary_tensors(self) -> list[int]:
        """Inkling 2: the entries of each stack of block states a step makes (one after each call of a block's first
        layer but the last layer's: checkpointing keeps each once; Inkling2-Loop's looped blocks once a pass)."""
        last = len(self.kinds) - 1
        made = [self.entries(j) + 1 for j in range(0, last, self.block_layers)]
        looped = [self.entries(j) + 1 for j in range(self.loop_start, min(self.loop_end, last), self.block_layers)]
        return made + looped * (self.passes - 1 if self.gate_rank else 0)


def layer_types(cfg: dict) -> tuple[str, ...]:
    """Each layer's kind as transformers' config class makes it: ``layer_types`` as given, else sliding but every
    sixth, or but the layers ``local_layer_ids`` does not name."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    n = cfg["num_hidden_layers"]
    local = set(cfg["local_layer_ids"]) if cfg.get("local_layer_ids") is not None else {
        i for i in range(n) if (i + 1) % 6}
    return tuple(SLIDING if i in local else FULL for i in range(n))


def inkling_entries(cfg: dict) -> dict:
    """An Inkling config.json with the MLP entries transformers' class reads from a checkpoint's: its
    ``mlp_layer_types`` (dense for the first ``dense_mlp_idx`` layers, else experts), and, where it names a
    ``dense_intermediate_size``, ``intermediate_size`` as the experts' width and that as the dense MLP's."""
    if cfg.get("model_type") not in FAMILIES:
        return cfg
    out = dict(cfg)
    if out.get("mlp_layer_types") is None:
        dense = out.get("dense_mlp_idx", 0)
        out["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(out["num_hidden_layers"])]
    if out.get("dense_intermediate_size") is not None:
        experts, dense = out["intermediate_size"], out["dense_intermediate_size"]
        out["moe_intermediate_size"], out["intermediate_size"] = experts, dense
    return out


def inkling_fields(cfg: dict) -> dict:
    """The ModelShape fields of an Inkling config.json beyond the common ones; a ValueError naming the fix for sizes
    transformers' model could not build."""
    kinds = layer_types(cfg)
    if set(kinds) - {SLIDING, FULL}:
        raise ValueError(f"Inkling's layer_types name {sorted(set(kinds) - {SLIDING, FULL})}: its layers are "
                         f"{SLIDING!r} and {FULL!r}; fix the config.json.")
    heads, second = cfg["num_attention_heads"], cfg.get("model_type") in SECOND
    defaults = (48, 8, 1024) if second else (64, 16, 512)  # the config classes' sliding heads, kv heads and window
    sizes = dict(sliding_heads=cfg.get("swa_num_attention_heads", defaults[0]), sliding_kv_heads=cfg.get(
        "swa_num_key_value_heads", defaults[1]), sliding_head_dim=cfg.get("swa_head_dim", 128),
        window=cfg.get("sliding_window_size", defaults[2]), rel_extent=cfg.get("rel_extent", 1024),
        d_rel=cfg.get("d_rel", 16), kernel=cfg.get("conv_kernel_size", cfg.get("sconv_kernel_size", 4)))
    if second:
        sizes |= dict(block_layers=cfg.get("n_layers_per_attn_res_block", 6),
                      head_vocab=cfg.get("unpadded_vocab_size", 200058))
    if cfg.get("model_type") in LOOP:
        sizes |= _loop_sizes(cfg, sizes["block_layers"])
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Inkling's {name} = {value!r} must be a positive integer; fix the config.json.")
    shape = InklingShape(kinds, **sizes, log_scaling=second or cfg.get("log_scaling_n_floor") is not None)
    for kind, (h, hk) in ((SLIDING, (shape.sliding_heads, shape.sliding_kv_heads)),
                          (FULL, (heads, cfg.get("num_key_value_heads") or heads))):
        if kind in kinds and h % hk:
            raise ValueError(f"Inkling's {kind} layers' {hk} key heads do not divide their {h} query heads; fix the "
                             "config.json.")
    if cfg.get("mlp_layer_types") and "sparse" in cfg["mlp_layer_types"] and not cfg.get("n_shared_experts"):
        raise ValueError("Inkling's experts need n_shared_experts >= 1 (its router's shared rows); fix the "
                         "config.json.")
    return {"inkling": shape, "given_layer_types": kinds}


def _loop_sizes(cfg: dict, block: int) -> dict:
    """Inkling2-Loop's looped layers, passes and gate rank as its config class reads them (a ``loop_config`` of
    ``core_start``, ``core_end``, ``num_passes``, ``gate_rank`` over the entries); a ValueError naming the fix where
    transformers' model could not be built."""
    given = cfg.get("loop_config") or {}
    out = dict(loop_start=given.get("core_start", cfg.get("loop_layer_index_start", 6)),
               loop_end=given.get("core_end", cfg.get("loop_layer_index_end", 18)),
               passes=given.get("num_passes", cfg.get("loop_num_passes", 3)),
               gate_rank=given.get("gate_rank", cfg.get("loop_gate_rank", 64)))
    for name, value in out.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Inkling2-Loop's {name} = {value!r} must be a positive integer; fix the config.json.")
    if out["loop_start"] % block or out["loop_end"] % block or not out["loop_start"] < out["loop_end"]:
        raise ValueError(f"Inkling2-Loop's looped layers {out['loop_start']} .. {out['loop_end'] - 1} must start and "
                         f"end at multiples of n_layers_per_attn_res_block ({block}); fix loop_layer_index_start and "
                         "loop_layer_index_end in the config.json.")
    return out  # a loop past the last layer loops the layers it holds (none: transformers runs no pass again)
