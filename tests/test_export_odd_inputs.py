"""Property-based fuzzing of the exported prefill and decode graphs (onnxruntime and
TVM) over odd inputs.

Each example takes a valid set of graph inputs and breaks at most one thing: a token
id below 0, at the vocabulary size or far beyond, an empty batch or sequence, a wrong
dtype or rank of ``input_ids``, a non-tensor, a wrong number of inputs; for decode also
two new tokens a sequence, caches of different lengths, of another batch, layer count
or width, dtype or rank. Valid inputs (every id in ``[0, V)``, strided views included,
decode caches of 0 to 4 positions from the eager prefill of a random prompt) are the
``ok`` class. The only allowed outcomes:

* ``ok``: the logits of the eager model's own forward over the same tokens (the whole
  prefix for decode), within 1e-4, with the right shapes of every output;
* a broken input: through glmport's runner, a ``GraphInputError`` naming that input;
  fed to the runtime directly (``InferenceSession.run``, the Relax VM's ``main``: what a
  user running the exported file without glmport does), the run fails with the
  runtime's error, never returns outputs; where the runtime would not check the input
  itself, that error comes from one of the graph's guards and says so.

Anything else fails: another exception type, a broken input accepted, wrong values or
shapes. Each graph is built once for the module; the counts per runtime, graph, class
and outcome (:mod:`fuzz_counts`' outcomes) are written as JSON lines to the file named
by ``FUZZ_COUNTS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fuzz_counts import (
    ACCEPTED_INVALID,
    BAD_REFUSAL,
    CORRECT,
    REFUSED,
    SILENT_WRONG,
    Counts,
    Outcome,
)
from hypothesis import event, given, settings
from hypothesis import strategies as st

import glmport
from glmport.export.graph import GraphInputError, PrefillGraph, empty_caches
from glmport.export.onnx_model import OnnxRuntimeModel, export_onnx
from glmport.export.ort_runtime import to_ort
from glmport.export.tvm_model import TvmModel
from glmport.export.tvm_runtime import to_tvm
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

TOLERANCE = 1e-4
# Examples per runtime, graph and class: the module runs in about a minute on two cores.
OK_EXAMPLES = 12
CLASS_EXAMPLES = 4
RUNTIMES = ("onnxruntime", "tvm")
# One dense and one MoE layer: every op of the model, the compile time of two layers.
CONFIG = GlmMoeDsaConfig.tiny(num_hidden_layers=2)
VOCAB = CONFIG.vocab_size
BAD_LOW = (-1, -2, -VOCAB, -VOCAB - 1, -(2**31), -(2**63))
BAD_HIGH = (VOCAB, VOCAB + 1, 2 * VOCAB, 2**31, 2**63 - 1)
WRONG_ID_DTYPES = (torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool)
WRONG_CACHE_DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.int64)

# class -> the input a glmport runner must name (None: a valid input).
PREFILL_CLASSES: dict[str, str | None] = {
    "ok": None,
    "id<0": "input_ids",
    "id>=V": "input_ids",
    "empty": "input_ids",
    "ids dtype": "input_ids",
    "ids rank": "input_ids",
    "not a tensor": "input_ids",
    "arity": "inputs",
}
DECODE_CLASSES: dict[str, str | None] = {
    **PREFILL_CLASSES,
    "seq!=1": "input_ids",
    "past mismatch": "past_index_keys",
    "batch mismatch": "past_latent",
    "layers": "past_latent",
    "width": "past_index_keys",
    "cache dtype": "past_latent",
    "cache rank": "past_index_keys",
}
CLASSES = {"prefill": PREFILL_CLASSES, "decode": DECODE_CLASSES}

COUNTS = Counts("export")
_write_counts = COUNTS.writer()


@dataclass
class Case:
    """One set of graph inputs, the class it was drawn from, and for an ``ok`` case the
    eager logits ``[batch, 1 or seq, V]`` the graph must give."""

    label: str
    inputs: tuple
    want: torch.Tensor | None = None

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        def show(x: object) -> str:
            if isinstance(x, torch.Tensor):
                body = x.tolist() if x.numel() <= 12 else "..."
                return f"tensor({body}, {x.dtype}, shape={list(x.shape)})"
            return repr(x)

        return f"Case({self.label}, {', '.join(map(show, self.inputs))})"


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).eval()


@pytest.fixture(scope="module")
def graphs(model):
    """Each (runtime, graph kind) built on first use, once for the module."""
    built: dict[tuple[str, str], object] = {}

    def get(runtime: str, kind: str):
        if (runtime, kind) not in built:
            if runtime == "onnxruntime":
                built[runtime, kind] = OnnxRuntimeModel.load(export_onnx(model, kind))
            else:
                built[runtime, kind] = TvmModel.build(model, kind)
        return built[runtime, kind]

    return get


def _eager(model: GlmMoeDsaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), glmport.use_backend("generic"):
        return model(ids).logits


def _layout(draw, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as itself, a transposed view, or a view into a wider tensor."""
    kind = draw(st.sampled_from(("contiguous", "transposed", "strided")))
    if kind == "transposed":
        return ids.t().contiguous().t()
    if kind == "strided":
        wide = torch.zeros(ids.shape[0], 2 * ids.shape[1], dtype=ids.dtype)
        wide[:, ::2] = ids
        return wide[:, ::2]
    return ids


@st.composite
def cases(draw, model: GlmMoeDsaForCausalLM, kind: str, label: str) -> Case:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    batch = draw(st.integers(1, 3))
    past = draw(st.integers(0, 4)) if kind == "decode" else 0
    seq = 1 if kind == "decode" else draw(st.integers(1, 6))
    tokens = torch.randint(0, VOCAB, (batch, past + seq), generator=gen)
    tokens[0, -1] = draw(st.sampled_from((0, VOCAB - 1, int(tokens[0, -1]))))  # both ends
    ids = tokens[:, past:]
    if kind == "prefill":
        caches = ()
    elif past:
        with torch.no_grad():
            caches = PrefillGraph(model)(tokens[:, :past])[1:]
    else:
        caches = empty_caches(model, batch)
    if label == "ok":
        want = _eager(model, tokens)[:, past:]
        return Case(label, (_layout(draw, ids), *caches), want)
    row, col = draw(st.integers(0, batch - 1)), draw(st.integers(0, seq - 1))
    if label in ("id<0", "id>=V"):
        ids = ids.clone()
        ids[row, col] = draw(st.sampled_from(BAD_LOW if label == "id<0" else BAD_HIGH))
    elif label == "empty":
        ids = ids[:0] if draw(st.booleans()) or kind == "decode" else ids[:, :0]
    elif label == "ids dtype":
        ids = ids.to(draw(st.sampled_from(WRONG_ID_DTYPES)))
    elif label == "ids rank":
        ids = ids.reshape(-1) if draw(st.booleans()) else ids[None]
    elif label == "not a tensor":
        ids = ids.tolist()
    elif label == "arity":
        return Case(label, (ids, *caches, ids) if draw(st.booleans()) else ())
    elif label == "seq!=1":
        ids = torch.cat((ids, ids), dim=1)
    else:
        caches = _broken_caches(draw, label, *caches)
    return Case(label, (ids, *caches))


def _broken_caches(draw, label: str, latent: torch.Tensor, keys: torch.Tensor) -> tuple:
    """The decode caches with the defect ``label``."""
    if label == "past mismatch":
        if keys.shape[2] and draw(st.booleans()):
            return latent, keys[:, :, 1:]
        return latent, torch.cat((keys, keys.new_zeros((*keys.shape[:2], 1, keys.shape[3]))), 2)
    if label == "batch mismatch":
        return torch.cat((latent, latent[:, :1]), dim=1), keys
    if label == "layers":
        return latent[:1], keys[:1]
    if label == "width":
        return latent, keys[..., :-1]
    if label == "cache dtype":
        return latent.to(draw(st.sampled_from(WRONG_CACHE_DTYPES))), keys
    assert label == "cache rank", label
    return latent, keys[0]


def _run_raw(runtime: str, graph, inputs: tuple) -> tuple:
    """Feed ``inputs`` to the runtime itself, without glmport's runner."""
    if runtime == "onnxruntime":
        names = [i.name for i in graph.session.get_inputs()]
        feed = {n: to_ort(t) for n, t in zip(names, inputs, strict=True)}
        return tuple(graph.session.run_with_ort_values(None, feed))
    return tuple(graph._main(*(to_tvm(t) for t in inputs)))


def _outcome(runtime: str, kind: str, graph, case: Case) -> Outcome:
    """Run ``case`` through glmport's runner and, where the runtime can take the
    inputs at all, straight into the runtime: how it ended."""
    expected = CLASSES[kind][case.label]
    try:
        out = graph.run(*case.inputs)
    except GraphInputError as err:
        if expected is None:
            return Outcome(BAD_REFUSAL, "GraphInputError", f"a valid input was refused: {err}")
        if err.input != expected or err.graph != kind or f"'{expected}'" not in str(err):
            problem = f"{case.label}: the error names {err.input!r}, expected {expected!r}: {err}"
            return Outcome(BAD_REFUSAL, "GraphInputError", problem)
    else:
        if expected is not None:
            problem = f"{case.label}: the broken {expected!r} was accepted"
            return Outcome(ACCEPTED_INVALID, problem=problem)
        wrong = _wrong_outputs(kind, case, out)
        return Outcome(SILENT_WRONG, problem=wrong) if wrong else Outcome(CORRECT)
    if case.label in ("not a tensor", "arity"):
        return Outcome(REFUSED, "no bare run: not a set of tensors")
    try:
        _run_raw(runtime, graph, case.inputs)
    except Exception as err:  # the runtime's own error type: what its users get
        if not _guarded_in_graph(runtime, kind, case.label):
            return Outcome(REFUSED, "bare runtime stopped by its own input check")
        if "glmport guard" not in str(err):
            problem = f"{case.label}: not the graph's guard: {err}"
            return Outcome(BAD_REFUSAL, "bare runtime stopped by its own input check", problem)
        return Outcome(REFUSED, "bare runtime stopped by a glmport guard")
    problem = f"{case.label}: the bare {runtime} graph ran on the broken input"
    return Outcome(ACCEPTED_INVALID, "bare runtime ran it", problem)


def _wrong_outputs(kind: str, case: Case, out: tuple) -> str | None:
    """What is wrong with the graph's outputs ``out`` for the valid ``case``, or None:
    three outputs, the eager logits within :data:`TOLERANCE`, caches of the right
    shapes."""
    if len(out) != 3:
        return f"{len(out)} outputs, not 3"
    if out[0].shape != case.want.shape:
        return f"logits of shape {list(out[0].shape)}, not {list(case.want.shape)}"
    diff = float((out[0].float() - case.want.float()).abs().max())
    if not diff <= TOLERANCE:
        return f"logits differ from eager torch by {diff:.3g}"
    b, s = case.want.shape[:2]
    past = case.inputs[1].shape[2] if kind == "decode" else 0
    for cache, width in zip(out[1:], (CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim,
                                      CONFIG.index_head_dim), strict=True):  # fmt: skip
        if list(cache.shape) != [CONFIG.num_hidden_layers, b, past + s, width]:
            return f"a cache of shape {list(cache.shape)}"
    return None


def _guarded_in_graph(runtime: str, kind: str, label: str) -> bool:
    """Whether a glmport guard inside the graph is what stops the bare runtime: ids out
    of range (which onnxruntime's Gather wraps from the end and TVM's reads past the
    embedding) and empty inputs in both, cache shapes in onnxruntime (its symbolic axes
    are not tied together). The rest the runtime's own signature checks refuse: dtypes,
    ranks, fixed sizes, and in TVM every size the signature ties (a decode batch of 0
    against caches of another batch among them)."""
    if label in ("id<0", "id>=V"):
        return True
    if label == "empty":
        return runtime == "onnxruntime" or kind == "prefill"
    return runtime == "onnxruntime" and label in ("past mismatch", "batch mismatch")


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_odd_inputs_are_refused_naming_the_input_or_computed_right(model, graphs, runtime, kind):
    # One test per graph (not per class): pytest-xdist may send each test to another
    # worker, and each graph is then still built once.
    graph = graphs(runtime, kind)
    for label in CLASSES[kind]:
        _fuzz(model, runtime, kind, graph, label)


def _fuzz(model, runtime: str, kind: str, graph, label: str) -> None:
    @settings(
        max_examples=OK_EXAMPLES if label == "ok" else CLASS_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
    )
    @given(case=cases(model, kind, label))
    def prop(case: Case) -> None:
        where = {"runtime": runtime, "graph": kind, "class": label}
        outcome = COUNTS.observe(lambda: _outcome(runtime, kind, graph, case), label, **where)
        event(str(outcome))

    prop()
