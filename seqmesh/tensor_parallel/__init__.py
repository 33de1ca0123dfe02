"""Tensor parallelism inside the sequence mesh: the ``tp`` axis, innermost (see ``plan``). Its loss, with a
vocabulary-parallel LM head, is the model's (``seqmesh.model.vocab_parallel``).
``seqmesh.compose.parallelize_model`` applies it (step 4)."""

from .plan import apply_tensor_parallel, check_tensor_parallel

__all__ = ["apply_tensor_parallel", "check_tensor_parallel"]
