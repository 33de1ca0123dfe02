"""What a causal LM does between its decoder's output and its logits, as ``SequenceParallelLM``'s loss reproduces it.

The loss never builds a shard's whole logits: it multiplies chunks of the decoder's output by the output embedding's
matrix inside the cross-entropy (``seqmesh.model.loss``). That equals the model's own logits where its forward
computes ``logits = lm_head(hidden)`` with a bias-free linear head, possibly times a constant: Cohere's
``logit_scale``, Granite's ``1 / logits_scaling``, which the loss applies to the hidden states instead
(``(s x) W^T = s (x W^T)``), and a final soft-cap ``c tanh(z / c)`` (Gemma 2's ``final_logit_softcapping``;
RecurrentGemma's ``logits_soft_cap``, in one statement; Inkling 2's ``logit_softcap`` module), which the loss applies
to each tile of logits. :func:`logit_head` reads the model's forward (its source, as transformers
ships it) and returns both; the head's bias (Phi's) the loss adds itself, and a per-token prediction head the decoder's
output goes through first (ModernBERT-decoder's ``self.decoder(self.lm_head(hidden))``; a head module that holds the
projection last, BERT's ``cls`` and RoBERTa's ``lm_head``: that module without its projection) it applies to each
token's state; anything else the forward does to its logits is refused by name, so the loss is never silently
another model's. Statements
under a condition on the model's attributes (``if self.config.final_logit_softcapping is not None``) count where
the condition holds for this model.
"""

from __future__ import annotations

import ast
import copy
import math
import functools
import inspect
import numbers
import textwrap
from typing import NamedTuple

import torch.nn as nn

_PASS_THROUGH = ("float", "to", "contiguous")  # calls on the logits that change no value the loss sees
_UNKNOWN = object()


@functools.lru_cache(maxsize=256)
def forward_source(cls: type) -> str:
    """The source of ``cls.forward`` as transformers ships it, dedented ("" where Python cannot read it): what
    seqmesh reads of a family's code (its logits here, its attention calls in ``seqmesh.hf.layers``)."""
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return ""


def _forward_tree(cls: type) -> ast.AST | None:
    try:
        return ast.parse(forward_source(cls)) if forward_source(cls) else None
    except SyntaxError:
        return None


_WIDENING = ("float", "contiguous")  # calls that change no value the loss sees, whatever the logits' dtype


def _uncast(node: ast.AST) -> ast.AST:
    """``node`` without its trailing ``.float()`` / ``.contiguous()`` calls (no arguments): the value itself."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _WIDENING \
            and not node.args and not node.keywords:
        node = node.func.value
    return node


_GETTERS = ("get_text_config",)  # methods without arguments that only read the config (Gemma 4's cap behind one)


def _value(node: ast.AST, model: nn.Module):
    """The value of an attribute chain on ``self`` (``self.config.logits_scaling``, through a config getter:
    ``self.config.get_text_config().final_logit_softcapping``), a constant, or ``_UNKNOWN``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return model
    if isinstance(node, ast.Attribute):
        owner = _value(node.value, model)
        return _UNKNOWN if owner is _UNKNOWN else getattr(owner, node.attr, _UNKNOWN)
    if isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute) \
            and node.func.attr in _GETTERS:
        getter = _value(node.func, model)
        return getter() if callable(getter) else _UNKNOWN
    return _UNKNOWN


def _holds(test: ast.AST, model: nn.Module):
    """Whether an ``if`` test on the model's attributes holds: True, False, or ``_UNKNOWN``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _holds(test.operand, model)
        return inner if inner is _UNKNOWN else not inner
    if isinstance(test, ast.BoolOp):
        parts = [_holds(v, model) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in parts else _UNKNOWN if _UNKNOWN in parts else True
        return True if True in parts else _UNKNOWN if _UNKNOWN in parts else False
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot)):
        left, right = _value(test.left, model), _value(test.comparators[0], model)
        if _UNKNOWN in (left, right):
            return _UNKNOWN
        return (left is right) == isinstance(test.ops[0], ast.Is)
    value = _value(test, model)
    return value if value is _UNKNOWN else bool(value)


class _Walrus(ast.NodeTransformer):
    """An ``if`` test with its assignment expressions (``(c := <value>) is not None``) replaced by their values, and
    those assignments, as statements that run before the test."""

    def __init__(self) -> None:
        self.bound: list[ast.Assign] = []

    def visit_NamedExpr(self, node: ast.NamedExpr) -> ast.AST:
        bound = ast.Assign(targets=[ast.Name(node.target.id, ast.Store())], value=node.value)
        self.bound.append(ast.fix_missing_locations(ast.copy_location(bound, node)))  # unparsed in refusals
        return self.visit(node.value)


def _statements(body: list[ast.stmt], model: nn.Module):
    """The statements of ``body`` in order, branches whose condition does not hold for ``model`` left out (an
    assignment inside a condition, Gemma 4's ``(c := ...) is not None``, yielded as a statement before it)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            walrus = _Walrus()
            test = walrus.visit(copy.deepcopy(stmt.test))  # the parsed forward left as it is
            yield from walrus.bound
            holds = _holds(test, model)
            if holds is not False:
                yield from _statements(stmt.body, model)
            if holds is not True:
                yield from _statements(stmt.orelse, model)
        elif isinstance(stmt, (ast.With, ast.For, ast.While, ast.Try)):
            yield from _statements(stmt.body, model)
        else:
            yield stmt


def _head_call(stmt: ast.stmt) -> tuple[str, str, ast.Call] | None:
    """``(target, attribute, call)`` of ``target = self.<attribute>(...)``, or None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if isinstance(call, ast.BinOp) and isinstance(call.op, (ast.Mult, ast.Div)):  # self.lm_head(x) * multiplier
        call = call.left
    while isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in _PASS_THROUGH \
            and isinstance(call.func.value, ast.Call):  # self.lm_head(x).contiguous()
        call = call.func.value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
            isinstance(call.func.value, ast.Name) and call.func.value.id == "self":
        return stmt.targets[0].id, call.func.attr, call
    return None


def _strip(node: ast.AST) -> ast.AST:
    """``node`` without what keeps its values: slices (``x[:, keep, :]``, ``slice_logits_to_keep(x, n)``) and casts
    (``x.to(dtype)``, ``x.float()``, ``x.contiguous()``)."""
    while True:
        if isinstance(node, ast.Subscript) and not _decoder_output(node):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "slice_logits_to_keep" \
                and node.args:
            node = node.args[0]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PASS_THROUGH:
            node = node.func.value
        else:
            return node


def _decoder_output(node: ast.AST) -> bool:
    """Whether ``node`` reads the decoder's output: ``outputs.last_hidden_state`` or ``outputs[0]`` (or either, as
    ``outputs.last_hidden_state if return_dict else outputs[0]``)."""
    if isinstance(node, ast.IfExp):
        return _decoder_output(_strip(node.body)) and _decoder_output(_strip(node.orelse))
    if isinstance(node, ast.Attribute):
        return node.attr == "last_hidden_state"
    return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and isinstance(node.slice, ast.Constant) and node.slice.value == 0)


def _input_scale(statements: list[ast.stmt], call: ast.Call, model: nn.Module, name: str) -> float:
    """The constant the decoder's output is multiplied by on its way to the LM head (MiniCPM's ``hidden_states /
    logits_scaling``): the head's argument traced back to ``outputs.last_hidden_state`` / ``outputs[0]`` through
    slices and constant factors; a ValueError for anything else (ProphetNet's n-gram streams)."""
    arg = _strip(call.args[0]) if call.args else None  # hidden_states[:, slice_indices, :], .to(dtype)
    if arg is not None and _decoder_output(arg):
        return 1.0
    if not isinstance(arg, ast.Name):
        raise ValueError(f"{name}'s LM head reads {ast.unparse(call)!r}, not the decoder's output, which is what "
                         "seqmesh's chunked loss multiplies; train it with your own loss on model(**batch).logits.")
    variable, scale = arg.id, 1.0
    for stmt in reversed(statements):
        target = stmt.target if isinstance(stmt, ast.AugAssign) else stmt.targets[0] \
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if not (isinstance(target, ast.Name) and target.id == variable):
            continue
        core = _strip(stmt.value)
        if isinstance(stmt, ast.Assign) and _decoder_output(core):
            return scale
        if isinstance(stmt, ast.Assign) and isinstance(core, ast.BinOp) and _decoder_output(_strip(core.left)):
            number = _value(core.right, model)  # outputs[0] / self.config.logits_mup_width_multiplier
            if isinstance(core.op, (ast.Mult, ast.Div)) and isinstance(number, numbers.Real) \
                    and not isinstance(number, bool) and number:
                return scale * (float(number) if isinstance(core.op, ast.Mult) else 1.0 / float(number))
        kept = isinstance(stmt, ast.Assign) and isinstance(core, ast.Name) and core.id == variable
        factor = None if kept else _factor(stmt, variable, model)
        if factor is _UNKNOWN:
            raise ValueError(f"{name}'s forward changes the decoder's output before its LM head "
                             f"({ast.unparse(stmt)!r}), which seqmesh's chunked loss does not reproduce; train it with "
                             "your own loss on model(**batch).logits.")
        scale *= 1.0 if factor is None else factor
    raise ValueError(f"seqmesh cannot trace {name}'s LM head input ({variable}) back to its decoder's output; train "
                     "it with your own loss on model(**batch).logits.")


def _factor(stmt: ast.stmt, name: str, model: nn.Module, known: dict | None = None):
    """What ``stmt`` does to the logits ``name``: None (nothing), a float factor, or ``_UNKNOWN`` (something else);
    ``known``: local names bound to the model's constants."""
    if isinstance(stmt, ast.AugAssign):
        target, op, operand = stmt.target, stmt.op, stmt.value
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0], stmt.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _PASS_THROUGH \
                and isinstance(value.func.value, ast.Name) and value.func.value.id == name:
            return None
        left = _uncast(value.left) if isinstance(value, ast.BinOp) else None  # Beam's ``logits.float() / cap``
        if not (isinstance(left, ast.Name) and left.id == name):
            return _UNKNOWN if isinstance(target, ast.Name) and target.id == name else None
        op, operand = value.op, value.right
    else:
        return None
    if not (isinstance(target, ast.Name) and target.id == name):
        return None
    number = (known or {}).get(operand.id, _UNKNOWN) if isinstance(operand, ast.Name) else _value(operand, model)
    if not isinstance(op, (ast.Mult, ast.Div)) or isinstance(number, bool) or not isinstance(number, numbers.Real):
        return _UNKNOWN
    return float(number) if isinstance(op, ast.Mult) else 1.0 / float(number)


class LogitHead(NamedTuple):
    """``logits = softcap * tanh(scale * (transform(hidden) @ W^T + b) / softcap)`` (no tanh where ``softcap`` is
    None; ``transform``: the name of the model's module the decoder's output goes through first, or None)."""

    scale: float = 1.0
    softcap: float | None = None
    transform: str | None = None
    # the output embedding's path inside ``transform`` where the head module holds it (BERT's cls:
    # "predictions.decoder"): the transform is that module with the projection left out; None: the whole module
    projection: str | None = None
    # the leading logits the forward keeps (Inkling's ``logits[..., :unpadded_vocab_size]`` of a padded head): the
    # loss uses the first ``vocab`` rows of W (and b); None: all
    vocab: int | None = None
    # a learned scale of each logit, ``(name, factor)``: the head's own ``(V,)`` parameter ``name`` times the constant
    # ``factor`` (Dory's ``logits * (logit_scale * logit_scale_factor)``): the loss scales W's rows by it; None: none
    column_scale: tuple[str, float] | None = None


# what a per-token prediction head before the output projection may hold (ModernBERT-decoder's dense, activation,
# norm): modules that read each token alone
_PER_TOKEN = (nn.Linear, nn.LayerNorm, nn.Identity, nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh)


def _per_token(module: nn.Module) -> bool:
    """Whether ``module`` and all it holds act on each token alone (linear maps, norms, activations; transformers'
    modules that only hold such, BERT's ``BertPredictionHeadTransform``)."""
    return all(m is module or isinstance(m, _PER_TOKEN) or "Norm" in type(m).__name__
               or type(m).__module__ in ("transformers.activations", "torch.nn.modules.activation")
               or (type(m).__module__.startswith("transformers.") and any(True for _ in m.children()))
               for m in module.modules())


def _transform(call: ast.Call, model: nn.Module, name: str) -> tuple[ast.Call, str | None]:
    """``self.<head>(self.<transform>(x))``: the call of the transform with ``x`` as the head's argument, and the
    transform's name (a per-token module of the model); the head's call itself and None otherwise."""
    arg = _strip(call.args[0]) if len(call.args) == 1 else None
    inner = arg.func.attr if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute)
                              and isinstance(arg.func.value, ast.Name) and arg.func.value.id == "self"
                              and len(arg.args) == 1) else None
    module = getattr(model, inner, None) if inner else None
    if not isinstance(module, nn.Module):
        return call, None
    if not _per_token(module):
        raise ValueError(f"{name}'s LM head reads {ast.unparse(call)!r}, where {inner} ({type(module).__name__}) is "
                         "not a per-token map seqmesh's chunked loss can apply first; train it with your own loss on "
                         "model(**batch).logits.")
    return arg, inner


def _returns_call_of(cls: type, child: str) -> bool:
    """Whether ``cls.forward`` ends by returning what ``self.<child>(...)`` returned, unchanged: ``return
    self.child(x)``, or ``y = self.child(x)`` then ``return y`` (no branch around them)."""
    tree = _forward_tree(cls)
    body = [s for s in tree.body[0].body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))] \
        if tree is not None else []
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return False

    def calls_child(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == child
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")

    returned = body[-1].value
    if calls_child(returned):
        return True
    before = body[-2] if len(body) > 1 else None
    return (isinstance(returned, ast.Name) and isinstance(before, ast.Assign) and len(before.targets) == 1
            and isinstance(before.targets[0], ast.Name) and before.targets[0].id == returned.id
            and calls_child(before.value))


# heads whose forward returns their projection's result as the logits, beside what the generic reading refuses
# (class name -> the projection's child, the condition on the module): XLM's prediction layer without adaptive softmax
# returns (self.proj(x),), with its own loss before it where given labels, which seqmesh does not pass
KNOWN_HEADS = {"XLMPredLayer": ("proj", lambda m: m.asm is False)}


def _known_head(module: nn.Module, child: str) -> bool:
    """Whether ``module`` is a head of :data:`KNOWN_HEADS` whose logits are its ``child``'s result."""
    known = KNOWN_HEADS.get(type(module).__name__)
    return known is not None and known[0] == child and bool(known[1](module))


def _projection_last(called: nn.Module, head: nn.Module, name: str, attribute: str) -> str:
    """The path of the output embedding ``head`` inside the head module ``called`` (BERT's ``cls``:
    ``predictions.decoder``), where everything ``called`` holds acts on each token alone and each module on the path
    returns its child's result unchanged (the projection is the last thing the logits go through); a ValueError
    naming what differs otherwise."""
    path = next(p for p, m in called.named_modules() if m is head)
    refuse = (f"{name}'s LM head {attribute} ({type(called).__name__}) transforms the decoder's output before its "
              f"output embedding ({path}: {type(head).__name__}) ")
    if not _per_token(called):
        raise ValueError(refuse + "with modules that are not per-token maps (linear maps, norms, activations), which "
                         "seqmesh's chunked loss does not apply; train it with your own loss on model(**batch).logits.")
    owner = called
    for child in path.split("."):
        if _known_head(owner, child):
            owner = getattr(owner, child)
            continue
        if not _returns_call_of(type(owner), child):
            raise ValueError(refuse + f"and {type(owner).__name__}'s forward does not return its {child}'s result as "
                             "it is (a branch, or a change after it), which seqmesh's chunked loss does not "
                             "reproduce; train it with your own loss on model(**batch).logits.")
        owner = getattr(owner, child)
    return path


def without_projection(module: nn.Module, path: str) -> nn.Module:
    """``module`` with its submodule at ``path`` (the output embedding) replaced by the identity, every parameter
    shared (shallow copies of the modules on the path, each with its own table of children): the per-token transform
    the head applies before its projection. Built per call, it holds nothing across calls (FSDP2's gathered weights
    are the ones it reads)."""
    first, _, rest = path.partition(".")
    top = copy.copy(module)
    top._modules = dict(module._modules)
    top._modules[first] = nn.Identity() if not rest else without_projection(module._modules[first], rest)
    return top


def _is_tanh(stmt: ast.stmt, name: str) -> bool:
    """Whether ``stmt`` is ``name = torch.tanh(name)``."""
    value = stmt.value if isinstance(stmt, ast.Assign) else None
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "tanh"
            and len(value.args) == 1 and isinstance(value.args[0], ast.Name) and value.args[0].id == name)


def _one_statement_softcap(stmt: ast.stmt, name: str, model: nn.Module, known: dict) -> float | None:
    """``c`` where ``stmt`` is ``name = tanh(name / c) * c`` (``torch.tanh``, ``nn.functional.tanh``) with one
    positive constant ``c``, read from the model or a local name bound to it (``known``); otherwise None."""
    value = stmt.value if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
        and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name else None
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and isinstance(value.left, ast.Call)):
        return None
    call = value.left
    inner = call.args[0] if len(call.args) == 1 and not call.keywords else None
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "tanh" and isinstance(inner, ast.BinOp)
            and isinstance(inner.op, ast.Div) and isinstance(inner.left, ast.Name) and inner.left.id == name):
        return None

    def constant(node: ast.AST):
        return known.get(node.id, _UNKNOWN) if isinstance(node, ast.Name) else _value(node, model)

    below, above = constant(inner.right), constant(value.right)
    if any(isinstance(c, bool) or not isinstance(c, numbers.Real) for c in (below, above)) or below != above \
            or below <= 0:
        return None
    return float(below)


def _vocabulary_slice(stmt: ast.stmt, name: str, model: nn.Module, known: dict):
    """``n`` where ``stmt`` is ``name = name[..., :n]`` (a slice of the vocabulary: the first ``n`` logits), ``n`` a
    constant of the model or a local name bound to one (None where it is None: no slice); ``_UNKNOWN`` where ``stmt``
    is no such slice."""
    value = stmt.value if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
        and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name else None
    if not (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id == name
            and isinstance(value.slice, ast.Tuple) and len(value.slice.elts) == 2
            and isinstance(value.slice.elts[0], ast.Constant) and value.slice.elts[0].value is Ellipsis
            and isinstance(value.slice.elts[1], ast.Slice) and value.slice.elts[1].lower is None
            and value.slice.elts[1].step is None and value.slice.elts[1].upper is not None):
        return _UNKNOWN
    upper = value.slice.elts[1].upper
    limit = known.get(upper.id, _UNKNOWN) if isinstance(upper, ast.Name) else _value(upper, model)
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0):
        return limit
    return _UNKNOWN


def _function_softcap(stmt: ast.stmt, name: str, model: nn.Module) -> float | None:
    """``c`` where ``stmt`` is ``name = f(name, c)``, ``f`` a function of the model's own module (xLSTM's
    ``soft_cap``) that gives ``c tanh(x / c)`` (tried on a few values) and ``c`` a positive constant of the model;
    otherwise None."""
    import sys

    import torch

    value = stmt.value if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
        and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and len(value.args) == 2
            and isinstance(value.args[0], ast.Name) and value.args[0].id == name and not value.keywords):
        return None
    function = getattr(sys.modules[type(model).__module__], value.func.id, None)
    cap = _value(value.args[1], model)
    if not callable(function) or isinstance(cap, bool) or not isinstance(cap, numbers.Real) or cap <= 0:
        return None
    probe = torch.tensor([-90.0, -3.0, -0.5, 0.0, 0.7, 5.0, 200.0], dtype=torch.float64)
    try:
        capped = function(probe, cap)
    except Exception:  # noqa: BLE001 - not a cap of this form
        return None
    expected = cap * torch.tanh(probe / cap)
    return float(cap) if isinstance(capped, torch.Tensor) and torch.allclose(capped, expected, rtol=1e-12, atol=0) \
        else None


def _module_softcap(stmt: ast.stmt, name: str, model: nn.Module) -> float | None:
    """``c`` where ``stmt`` is ``name = self.m(name)``, ``m`` a module of the model without parameters whose forward
    is the one statement ``return tanh(x / c) * c`` (Inkling 2's ``logit_softcap``), ``c`` a positive constant of
    the module; otherwise None."""
    value = stmt.value if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
        and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == name else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Name) and value.func.value.id == "self" and len(value.args) == 1
            and isinstance(value.args[0], ast.Name) and value.args[0].id == name and not value.keywords):
        return None
    module = getattr(model, value.func.attr, None)
    if not isinstance(module, nn.Module) or next(module.parameters(), None) is not None:
        return None
    tree = _forward_tree(type(module))
    function = tree.body[0] if tree is not None and tree.body else None
    if not isinstance(function, ast.FunctionDef) or len(function.args.args) != 2:
        return None
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    argument = function.args.args[1].arg  # the forward's input, as ``name = <its return value>``
    returned = ast.Assign(targets=[ast.Name(argument, ast.Store())], value=body[0].value)
    return _one_statement_softcap(returned, argument, module, {})


def _column_scale(head: nn.Module) -> tuple[str, float] | None:
    """``(name, factor)`` where ``head`` is a bias-free ``nn.Linear`` whose forward is ``z = super().forward(x)`` (a
    cast allowed), then ``return z * (self.<name> * self.<factor>)`` (casts allowed), ``<name>`` a ``(V,)``
    parameter and ``<factor>`` a number (Dory's head); otherwise None."""
    tree = _forward_tree(type(head))
    function = tree.body[0] if tree is not None and tree.body else None
    if not isinstance(head, nn.Linear) or type(head).__mro__[1] is not nn.Linear or head.bias is not None \
            or not isinstance(function, ast.FunctionDef) or len(function.args.args) != 2:
        return None  # super() must reach nn.Linear's own forward
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 2 or not isinstance(body[0], ast.Assign) or not isinstance(body[1], ast.Return):
        return None

    bare, argument = _uncast, function.args.args[1].arg
    first, returned = body[0], body[1].value
    call = bare(first.value)
    if not (len(first.targets) == 1 and isinstance(first.targets[0], ast.Name) and isinstance(call, ast.Call)
            and [a.id if isinstance(a, ast.Name) else None for a in call.args] == [argument] and not call.keywords
            and isinstance(call.func, ast.Attribute) and call.func.attr == "forward"
            and isinstance(call.func.value, ast.Call) and isinstance(call.func.value.func, ast.Name)
            and call.func.value.func.id == "super"):
        return None
    if not (isinstance(returned, ast.BinOp) and isinstance(returned.op, ast.Mult)
            and isinstance(bare(returned.left), ast.Name) and bare(returned.left).id == first.targets[0].id):
        return None
    scale = bare(returned.right)
    if not (isinstance(scale, ast.BinOp) and isinstance(scale.op, ast.Mult)):
        return None
    name, factor = bare(scale.left), bare(scale.right)
    if not (isinstance(name, ast.Attribute) and isinstance(name.value, ast.Name) and name.value.id == "self"):
        return None
    vector, number = getattr(head, name.attr, None), _value(factor, head)
    if not (isinstance(vector, nn.Parameter) and tuple(vector.shape) == (head.out_features,)
            and isinstance(number, numbers.Real) and not isinstance(number, bool)):
        return None
    return name.attr, float(number)


def logit_head(lm: nn.Module) -> LogitHead:
    """The constant ``scale`` and the final ``softcap`` of ``lm``'s logits (``W``: its output embedding's weight);
    a ValueError naming what else the forward does to its logits, which the chunked loss would not."""
    name = type(lm).__name__
    head = lm.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{name} has no output embedding (get_output_embeddings() is {head!r}): seqmesh's loss "
                         "multiplies the decoder's output by its weight. Train it with your own loss on model(**batch).")
    tree = _forward_tree(type(lm))
    statements = list(_statements(tree.body[0].body, lm)) if tree is not None else []
    found = next(((i, call) for i, s in enumerate(statements) if (call := _head_call(s))
                  and isinstance(getattr(lm, call[1], None), nn.Module)
                  and any(m is head for m in getattr(lm, call[1]).modules())), None)
    if found is None:
        raise ValueError(f"seqmesh cannot read how {name} computes its logits from its decoder's output (no "
                         "'logits = self.<head>(...)' in its forward), so its chunked loss might be another model's; "
                         "train it with your own loss on model(**batch).logits.")
    index, (logits, attribute, call) = found
    called = getattr(lm, attribute)
    column_scale = _column_scale(head) if isinstance(head, nn.Linear) and type(head).forward is not nn.Linear.forward \
        else None
    if (not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward) and column_scale is None:
        raise ValueError(f"{name}'s LM head ({type(head).__name__}) computes its logits with a forward of its own, not "
                         "a plain linear map, which seqmesh's chunked loss does not reproduce; train it with your own "
                         "loss on model(**batch).logits.")
    projection = None
    if called is not head:  # BERT's cls, RoBERTa's lm_head: per-token maps, then the output embedding, returned
        projection = _projection_last(called, head, name, attribute)
        # a known head that holds its projection alone applies nothing before it (XLM's returns a tuple of logits)
        alone = _known_head(called, projection) and list(called.children()) == [head]
        transform = None if alone else attribute
    else:
        call, transform = _transform(call, lm, name)  # ModernBERT-decoder: self.decoder(self.lm_head(hidden_states))
    scale = _input_scale(statements[:index], call, lm, name)
    value = statements[index].value
    if isinstance(value, ast.BinOp):  # Falcon-H1: logits = self.lm_head(hidden) * self.model.lm_head_multiplier
        number = _value(value.right, lm)
        if isinstance(number, bool) or not isinstance(number, numbers.Real) or not number:
            raise ValueError(f"{name}'s forward scales its logits by {ast.unparse(value.right)!r}, which is not a "
                             "constant seqmesh can read; train it with your own loss on model(**batch).logits.")
        scale *= float(number) if isinstance(value.op, ast.Mult) else 1.0 / float(number)
    effects: list[tuple[float | None, ast.stmt]] = []  # each change of the logits: a factor, or None for tanh
    vocab = None  # the leading logits kept (a slice of a padded vocabulary), or None: all
    known: dict[str, object] = {}  # local names bound to the model's constants (RecurrentGemma's cap)
    for stmt in statements[index + 1:]:
        cap = _one_statement_softcap(stmt, logits, lm, known)
        cap = cap if cap is not None else _function_softcap(stmt, logits, lm)
        cap = cap if cap is not None else _module_softcap(stmt, logits, lm)
        if cap is not None:  # logits = tanh(logits / cap) * cap (or a function of the family's giving it): a soft-cap
            effects += [(1.0 / cap, stmt), (None, stmt), (cap, stmt)]
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and stmt.targets[0].id != logits:
            known[stmt.targets[0].id] = _value(stmt.value, lm)
        kept = _vocabulary_slice(stmt, logits, lm, known)
        if kept is not _UNKNOWN:  # the first `kept` logits (None: all); a larger number keeps every one
            vocab = kept if kept is not None and kept < head.weight.shape[0] else vocab
            continue
        factor = _factor(stmt, logits, lm, known)
        if factor is _UNKNOWN and not _is_tanh(stmt, logits):
            raise ValueError(f"{name}'s forward changes its logits after the LM head ({ast.unparse(stmt)!r}), which "
                             "seqmesh's chunked loss does not reproduce; train it with your own loss on "
                             "model(**batch).logits, or turn that setting off in its config.")
        if factor is not None:
            effects.append((None if factor is _UNKNOWN else factor, stmt))
    tanh = [i for i, (factor, _) in enumerate(effects) if factor is None]
    softcap = None
    if tanh:  # only "/ c, tanh, * c" last: a soft-cap of the scaled logits
        i = tanh[0]
        cap = effects[i + 1][0] if i + 1 < len(effects) else None
        if len(tanh) > 1 or i == 0 or cap is None or i + 2 != len(effects) or cap <= 0 \
                or not math.isclose(effects[i - 1][0] * cap, 1.0, rel_tol=1e-12):
            raise ValueError(f"{name}'s forward applies tanh to its logits ({ast.unparse(effects[i][1])!r}) other "
                             "than as a final soft-cap (logits / c, tanh, * c), which seqmesh's chunked loss does not "
                             "reproduce; train it with your own loss on model(**batch).logits.")
        softcap, effects = cap, effects[: i - 1]
    scale *= math.prod(factor for factor, _ in effects)
    if transform is not None and scale != 1.0:
        raise ValueError(f"{name} scales its logits by {scale:g} beside its prediction head ({transform}), which "
                         "seqmesh's chunked loss does not reproduce; train it with your own loss on "
                         "model(**batch).logits.")
    if getattr(head, "bias", None) is not None and scale != 1.0:
        raise ValueError(f"{name}'s LM head ({type(head).__name__}) adds a bias to logits it also scales by {scale:g}, "
                         "which seqmesh's chunked loss (scaling the hidden states, not the logits) does not reproduce; "
                         "train it with your own loss on model(**batch).logits.")
    return LogitHead(scale, softcap, transform, projection, vocab, column_scale)
