"""The sizes a decoder's config may hold: one check, shared by the config.json reader (``seqmesh train``, ``verify``
and ``plan`` read every model through it), :class:`seqmesh.model.shapes.ModelShape` and ``seqmesh.hf.parallelize``.

Each rule names the config.json field, its value, the rule and the fix, before any work: a size out of range
otherwise surfaces as "max() arg is an empty sequence" while degrees are chosen, a raw traceback from deep inside
transformers, or (0 layers, hidden 0) a run that trains nothing and exits 0. Torch-free: ``seqmesh plan`` uses it.

The rules:

- ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size`` (or, for a mixture of
  experts, ``moe_intermediate_size``) and ``vocab_size`` are positive integers (JSON numbers without a fraction);
- ``num_key_value_heads``, when given, is a positive integer dividing ``num_attention_heads`` (each kv head
  serves the same number of query heads);
- the head dim, ``head_dim`` or else ``hidden_size / num_attention_heads`` (which must then divide evenly), is a
  positive even number, its rotary part (``partial_rotary_factor``) too: rotary embeddings turn pairs of
  dimensions;
- ``vocab_size`` is at most ``MAX_VOCAB`` = 2**32 tokens: tokenizers number tokens with 32-bit ids (Hugging Face
  ``tokenizers`` and ``sentencepiece`` alike), so a larger table holds rows no token can reach; published models
  have at most a few hundred thousand;
- the experts (``num_experts``, ``num_local_experts`` or ``n_routed_experts``), when given, are a non-negative
  integer, and ``num_experts_per_tok`` between 1 and their number.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

MAX_VOCAB = 2**32  # tokenizers' ids are 32-bit: no token reaches a row beyond
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _reader(config: Mapping[str, Any] | object) -> Callable[[str], Any]:
    """A field's value in a config.json's object (a dict) or a transformers config (attributes); None if absent."""
    if isinstance(config, Mapping):
        return config.get
    return lambda name: getattr(config, name, None)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(where: str, name: str, value: Any, what: str) -> int:
    """``value`` if it is a positive integer, else a ValueError naming ``name`` (``what``: what it counts)."""
    if value is None:
        raise ValueError(f"{where} has no {name} entry ({what}); seqmesh needs a decoder-only transformer config, "
                         "which has one.")
    if not _is_integer(value):
        raise ValueError(f"{where}: {name} = {value!r} ({type(value).__name__}): {what} is a positive integer; write "
                         "it as one, without quotes, a decimal point or an exponent (JSON reads 1e12 as a float).")
    if value < 1:
        raise ValueError(f"{where}: {name} = {value}: {what} must be at least 1. Fix {name} in the config (the model's "
                         "published config.json has the right value).")
    return value


def _rotary_fraction(read: Callable[[str], Any]) -> float:
    """The share of each head's dims that rotary embeddings turn (``partial_rotary_factor``, at the top level or in
    ``rope_parameters``); 1 when the config names none."""
    rope = read("rope_parameters")
    factor = read("partial_rotary_factor")
    if factor is None and isinstance(rope, Mapping):
        factor = rope.get("partial_rotary_factor")
    return float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0


def check_head_dim(where: str, head_dim: int, rotary_fraction: float = 1.0, given: bool = True) -> None:
    """Refuse an odd head dim (or an odd rotary part of it); ``given``: written as ``head_dim`` (else derived as
    hidden_size / num_attention_heads, and the fix is another of those)."""
    rotary = int(head_dim * rotary_fraction)
    if rotary % 2 == 0:
        return
    source = "head_dim" if given else "hidden_size / num_attention_heads"
    part = f" (its rotary part, partial_rotary_factor {rotary_fraction:g}, is {rotary})" if rotary != head_dim else ""
    fix = "an even head_dim" if given else "sizes whose quotient is even, or an even head_dim"
    example = f" (e.g. {head_dim + 1})" if rotary == head_dim else ""
    raise ValueError(f"{where}: the head dim {source} = {head_dim}{part} is odd: rotary position embeddings turn pairs of "
                     f"dimensions, so each head needs an even number of them. Give {fix}{example}.")


def check_model_sizes(config: Mapping[str, Any] | object, where: str) -> None:
    """Raise a ValueError naming the first size of ``config`` (a config.json's object, or a transformers config) that
    breaks a rule of this module, its value and the fix; ``where`` names the config (its path, or the model)."""
    read = _reader(config)
    hidden = _positive(where, "hidden_size", read("hidden_size"), "the hidden size (the width of every token's state)")
    _positive(where, "num_hidden_layers", read("num_hidden_layers"), "the number of decoder layers")
    heads = _positive(where, "num_attention_heads", read("num_attention_heads"), "the number of query heads")
    kv_heads = read("num_key_value_heads")
    if kv_heads is not None:
        _positive(where, "num_key_value_heads", kv_heads, "the number of kv heads")
        if heads % kv_heads:
            fits = ", ".join(str(k) for k in range(1, heads + 1) if heads % k == 0)
            raise ValueError(f"{where}: num_key_value_heads = {kv_heads} does not divide num_attention_heads = {heads}: "
                             f"grouped-query attention gives every kv head the same number of query heads. Use "
                             f"num_key_value_heads in {fits}.")
    head_dim = read("head_dim")
    if head_dim is not None:
        head_dim = _positive(where, "head_dim", head_dim, "the head dim")
    elif hidden % heads:
        fits = ", ".join(str(h) for h in range(1, min(hidden, 256) + 1) if hidden % h == 0 and hidden // h % 2 == 0)
        raise ValueError(f"{where}: num_attention_heads = {heads} does not divide hidden_size = {hidden}, and no head_dim "
                         f"is given (it would be hidden_size / num_attention_heads). Give head_dim, or use "
                         f"num_attention_heads in {fits}.")
    check_head_dim(where, head_dim if head_dim is not None else hidden // heads, _rotary_fraction(read),
                   given=head_dim is not None)
    vocab = _positive(where, "vocab_size", read("vocab_size"), "the vocabulary (tokens the embedding holds)")
    if vocab > MAX_VOCAB:
        raise ValueError(f"{where}: vocab_size = {vocab:,} is above {MAX_VOCAB:,} (2**32): tokenizers number tokens with "
                         "32-bit ids, so no token could reach the rows beyond (published models have at most a few "
                         "hundred thousand). Use the vocabulary of the model's tokenizer.")
    name, experts = next(((n, read(n)) for n in EXPERT_FIELDS if read(n) is not None), (EXPERT_FIELDS[0], None))
    if experts is not None and (not _is_integer(experts) or experts < 0):
        raise ValueError(f"{where}: {name} = {experts!r}: the number of experts per layer is a whole number (0: a dense "
                         "MLP).")
    if experts:
        per_token = read("num_experts_per_tok")
        if per_token is not None and (not _is_integer(per_token) or not 1 <= per_token <= experts):
            raise ValueError(f"{where}: num_experts_per_tok = {per_token!r}: each token goes to between 1 and the "
                             f"{experts} experts ({name}); use a number in that range.")
        if read("moe_intermediate_size") is not None:
            _positive(where, "moe_intermediate_size", read("moe_intermediate_size"), "each expert's MLP width")
            return
    _positive(where, "intermediate_size", read("intermediate_size"), "the MLP width")
