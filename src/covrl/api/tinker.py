"""A Tinker-compatible facade: the names and request/response shapes of Tinker's public Python SDK mapped onto
covrl.api, running locally (written from Tinker's documented types; tested with covrl's own copies of them
and with the SDK's own `tinker.types` objects when the `tinker` package is importable).

    import covrl.api.tinker as tinker                     # instead of `import tinker`
    from covrl.api.tinker import types
    service_client = tinker.ServiceClient(config="tiny")  # covrl addition: which preset/config backs it
    training_client = service_client.create_lora_training_client(base_model="tiny", rank=32)
    sampling_client = training_client.save_weights_and_get_sampling_client(name="000001")
    result = sampling_client.sample(prompt=types.ModelInput.from_ints(ids), num_samples=8,
                                    sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0)).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": lp, "advantages": adv})
    training_client.forward_backward([datum], loss_fn="importance_sampling").result()
    training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result()

Conventions (Tinker's): position i of `model_input` predicts `target_tokens[i]`; losses are per-token SUMS
over the Datum's positions (prompt positions carry advantage 0 and so add nothing to the RL losses); `logprobs`
in loss_fn_inputs are the sampler's. covrl scores the sequence itself, so `target_tokens` must be `model_input`
shifted by one (`target_tokens[i] == model_input[i + 1]`) wherever the position has a weight: a target whose
weight is 0 (or, without weights, whose advantage and log-prob are 0, as the cookbook's prompt positions) is
ignored, as Tinker ignores it; other targets are refused, naming the position.
The mismatch metrics (covrl.math.rollout_correction) are computed on the sampled positions: `weights > 0`
when given, else positions with a non-zero `logprobs` or `advantages`.
Calls return futures that are already done (`.result()`, `await .result_async()`); `*_async` variants exist.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
import types as _pytypes
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from covrl.api import types as api_types
from covrl.api.client import SNAPSHOT_DIR, resolve_config
from covrl.api.client import SamplingClient as _ApiSamplingClient
from covrl.api.client import TrainingClient as _ApiTrainingClient
from covrl.api.losses import API_LOSSES
from covrl.api.multilora import SharedBases, lora_client
from covrl.api.types import StaleSamplingClientError, TrainBatch
from covrl.models import LoraConfig
from covrl.train import CheckpointError

# Tinker's loss names whose meaning differs from covrl.math's entry of the same name
_TINKER_NAMES = {"cispo": "tinker_cispo", "gspo": "tinker_gspo", "dro": "tinker_dro"}
_KEY_DTYPE = {"target_tokens": "int64"}
_ATTN, _MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
CLIENT_FILE = "tinker_client.json"   # in each training client's folder: how to build it again from a state
HELD_LOADED = 2   # full fine-tunes: weights of sampling clients read back from disk and kept loaded (LRU)


# ------------------------------------------------------------------------------------------------ types

@dataclass(frozen=True)
class EncodedTextChunk:
    tokens: Sequence[int]
    type: str = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class _Image:
    """Image chunks are accepted as types and refused in a model input (covrl's models read text)."""

    @property
    def length(self) -> int:
        raise ValueError("model_input: image chunks are not supported here (covrl trains text models)")


@dataclass(frozen=True)
class ImageChunk(_Image):
    """Tinker's image input chunk."""
    data: bytes
    format: str
    expected_tokens: int | None = None
    type: str = "image"


@dataclass(frozen=True)
class ImageAssetPointerChunk(_Image):
    """Tinker's pointer to an image asset."""
    location: str
    format: str
    expected_tokens: int | None = None
    type: str = "image_asset_pointer"


ModelInputChunk = EncodedTextChunk | ImageChunk | ImageAssetPointerChunk
StopReason = Literal["length", "stop"]


class TinkerError(Exception):
    """Tinker's base error class (the SDK raises its subclasses; recipes catch it)."""


class CheckpointExistsError(TinkerError, ValueError):
    """A save under a name that already holds a checkpoint, without `overwrite=True` (the SDK's 409 Conflict)."""


@dataclass(frozen=True)
class ModelInput:
    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls([EncodedTextChunk([int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls([])

    def to_ints(self) -> list[int]:
        if any(not isinstance(c, EncodedTextChunk) and not hasattr(c, "tokens") for c in self.chunks):
            raise ValueError("model_input: image chunks are not supported here (covrl trains text models)")
        return [int(t) for c in self.chunks for t in c.tokens]

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput([*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk([int(token)]))


class TensorData:
    """A flat array with its dtype ("int64" / "float32") and shape."""

    def __init__(self, data: Sequence, dtype: str = "float32", shape: Sequence[int] | None = None):
        self._array = np.asarray(data, dtype=np.int64 if dtype == "int64" else np.float32)
        if shape is not None:
            self._array = self._array.reshape(list(shape))
        self.dtype, self.shape = dtype, list(self._array.shape)

    @property
    def data(self) -> list:
        return self._array.reshape(-1).tolist()

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        return cls(array, "int64" if np.issubdtype(array.dtype, np.integer) else "float32", array.shape)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        return self._array.copy()

    def to_torch(self) -> torch.Tensor:
        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return self._array.tolist()

    def __repr__(self) -> str:
        return f"TensorData(dtype={self.dtype!r}, shape={self.shape})"


def _to_tensor_data(key: str, value) -> Any:
    if hasattr(value, "to_torch") or hasattr(value, "tolist") and not isinstance(value, (torch.Tensor, np.ndarray)):
        return value
    if isinstance(value, torch.Tensor):
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, (list, tuple)):
        return TensorData(list(value), _KEY_DTYPE.get(key, "float32"))
    raise TypeError(f"loss_fn_inputs[{key!r}]: unsupported value of type {type(value).__name__}")


@dataclass(frozen=True)
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "loss_fn_inputs",
                           {k: _to_tensor_data(k, v) for k, v in dict(self.loss_fn_inputs).items()})


AdamParams = api_types.AdamParams   # the same names: learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


@dataclass(frozen=True)
class SampledSequence:
    stop_reason: str
    tokens: list[int]
    logprobs: list[float] | None = None


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    type: str = "sample"


@dataclass
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] | None = None


@dataclass
class SaveWeightsResponse:
    path: str
    type: str = "save_weights"


@dataclass
class SaveWeightsForSamplerResponse:
    path: str
    type: str = "save_weights_for_sampler"


@dataclass
class LoadWeightsResponse:
    path: str | None = None
    type: str = "load_weights"


def _module(name: str, **attrs) -> _pytypes.ModuleType:
    module = _pytypes.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module    # importable by its dotted name, as the SDK's package modules are
    return module


# `types` and `types.tensor_data` are modules, as in the SDK (`from tinker.types.tensor_data import TensorData`)
tensor_data = _module(f"{__name__}.types.tensor_data", TensorData=TensorData)
types = _module(
    f"{__name__}.types", AdamParams=AdamParams, Datum=Datum, EncodedTextChunk=EncodedTextChunk,
    ForwardBackwardOutput=ForwardBackwardOutput, ImageAssetPointerChunk=ImageAssetPointerChunk,
    ImageChunk=ImageChunk, LoadWeightsResponse=LoadWeightsResponse, ModelInput=ModelInput,
    ModelInputChunk=ModelInputChunk, OptimStepResponse=OptimStepResponse, SampledSequence=SampledSequence,
    SampleResponse=SampleResponse, SamplingParams=SamplingParams, StopReason=StopReason,
    SaveWeightsForSamplerResponse=SaveWeightsForSamplerResponse, SaveWeightsResponse=SaveWeightsResponse,
    TensorData=TensorData, tensor_data=tensor_data)


def install_as_tinker() -> None:
    """Make `import tinker` (and `tinker.types`, `tinker.types.tensor_data`) this facade in this process, so a
    recipe written for the SDK runs unchanged: `python -m covrl.api.tinker RECIPE.py [args]` does this first."""
    this = sys.modules[__name__]
    sys.modules["tinker"], sys.modules["tinker.types"] = this, types
    sys.modules["tinker.types.tensor_data"] = tensor_data


class APIFuture:
    """A completed call: `.result(timeout=None)`, `await .result_async()`; awaiting it gives the result too."""

    def __init__(self, value):
        self._value = value

    def result(self, timeout: float | None = None):
        return self._value

    async def result_async(self, timeout: float | None = None):
        return self._value

    def __await__(self):
        return self.result_async().__await__()


# ---------------------------------------------------------------------------------------------- conversion

def _ints(model_input, where: str) -> list[int]:
    if not hasattr(model_input, "to_ints"):
        raise TypeError(f"{where}: expected a ModelInput (with to_ints()), got {type(model_input).__name__}")
    return [int(t) for t in model_input.to_ints()]


def _values(value, where: str) -> list:
    if hasattr(value, "to_torch"):
        return value.to_torch().reshape(-1).tolist()
    if hasattr(value, "tolist"):
        return list(np.asarray(value.tolist()).reshape(-1))
    return list(value)


def data_to_batch(data: Sequence, loss_name: str, pad_id: int) -> TrainBatch:
    """Tinker Datums -> a TrainBatch: prompt = the first input token, response = target_tokens (each datum's
    N positions), so row i position j is model_input position j predicting target j."""
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("data: a non-empty list of Datum")
    prompts, responses, per_key = [], [], {"logprobs": [], "advantages": [], "weights": []}
    for i, d in enumerate(data):
        tokens = _ints(getattr(d, "model_input", None), f"data[{i}].model_input")
        inputs = dict(getattr(d, "loss_fn_inputs", {}) or {})
        if not tokens:
            raise ValueError(f"data[{i}].model_input: empty")
        if "target_tokens" not in inputs:
            raise ValueError(f"data[{i}].loss_fn_inputs['target_tokens']: missing (required by every loss)")
        unknown = [k for k in inputs if k not in ("target_tokens", *per_key)]
        if unknown:
            raise ValueError(f"data[{i}].loss_fn_inputs{unknown}: not supported here (supported: target_tokens, "
                             f"{', '.join(per_key)})")
        targets = [int(t) for t in _values(inputs["target_tokens"], f"data[{i}].target_tokens")]
        n = len(tokens)
        for key in ("target_tokens", *per_key):
            if key in inputs:
                got = len(targets) if key == "target_tokens" else len(_values(inputs[key], key))
                if got != n:
                    raise ValueError(f"data[{i}].loss_fn_inputs[{key!r}]: {got} values but model_input has {n} "
                                     f"tokens")
        values = {key: [float(v) for v in _values(inputs[key], key)] if key in inputs else None for key in per_key}
        for j in range(n - 1):
            if targets[j] == tokens[j + 1]:
                continue
            if _weightless(values, j):   # Tinker ignores a target whose weight is 0: so does the facade
                targets[j] = tokens[j + 1]
                continue
            raise ValueError(f"data[{i}].loss_fn_inputs['target_tokens'][{j}] = {targets[j]} but "
                             f"model_input[{j + 1}] = {tokens[j + 1]}: covrl scores the sequence itself, so a "
                             "target with a non-zero weight must be model_input shifted by one")
        prompts.append(tokens[:1])
        responses.append(targets)
        for key in per_key:
            per_key[key].append(values[key])
    for key, rows in per_key.items():
        present = [r is not None for r in rows]
        if any(present) and not all(present):
            first = present.index(False)
            raise ValueError(f"data[{first}].loss_fn_inputs[{key!r}]: missing (other datums have it)")
    spec = API_LOSSES[loss_name]
    for key, field_name in (("advantages", "advantages"), ("sampler_logprobs", "logprobs")):
        if key in spec.requires and per_key[field_name][0] is None:
            raise ValueError(f"data[0].loss_fn_inputs[{field_name!r}]: missing (required by loss_fn {loss_name!r})")
    lp, adv, w = (per_key[k] if per_key[k][0] is not None else None for k in ("logprobs", "advantages", "weights"))
    batch = TrainBatch.from_sequences(prompts, responses, sampler_logprobs=lp, advantages=adv, weights=w,
                                      pad_id=pad_id)
    if w is None:   # the sampled positions: a non-zero sampler log-prob or advantage (prompt positions have 0)
        sampled = torch.zeros_like(batch.response_mask)
        for src in (batch.sampler_logprobs, batch.advantages):
            if src is not None:
                sampled = torch.maximum(sampled, (src != 0).float())
        if lp is None and adv is None:
            sampled = batch.response_mask.clone()
        batch = TrainBatch(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                           batch.sampler_logprobs, batch.advantages, None, sampled * batch.response_mask)
    return batch


def _weightless(values: dict[str, list[float] | None], j: int) -> bool:
    """Position j adds nothing to any loss: weight 0 when weights are given, else advantage 0 and sampler
    log-prob 0 (a prompt position of an RL datum)."""
    if values["weights"] is not None:
        return values["weights"][j] == 0.0
    given = [values[k] for k in ("advantages", "logprobs") if values[k] is not None]
    return bool(given) and all(v[j] == 0.0 for v in given)


def _loss_name(loss_fn: str) -> str:
    name = _TINKER_NAMES.get(loss_fn, loss_fn)
    if name not in API_LOSSES:
        allowed = sorted({*(n for n in API_LOSSES if not n.startswith("tinker_")), *_TINKER_NAMES})
        raise ValueError(f"loss_fn: unknown loss {loss_fn!r}; allowed: {', '.join(allowed)}")
    return name


def _adam(params) -> AdamParams:
    if params is None:
        return AdamParams()
    if isinstance(params, AdamParams):
        return params
    fields = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    return AdamParams(**{f: getattr(params, f) for f in fields if hasattr(params, f)})


@dataclass(frozen=True)
class _Sampling:
    """Tinker's SamplingParams in covrl.api's terms: `greedy` for temperature 0 (argmax; the log-probs then
    are the model's at temperature 1, untruncated), `no_stop` for `stop=[]` (no stop at all, EOS included:
    every sample runs to max_tokens)."""
    params: api_types.SamplingParams
    greedy: bool = False
    no_stop: bool = False


def _sampling(params) -> _Sampling:
    if params is None:
        return _Sampling(api_types.SamplingParams())
    get = lambda name: getattr(params, name, None)  # noqa: E731 - also reads the SDK's own SamplingParams
    stop = get("stop")
    no_stop = stop is not None and not isinstance(stop, (str, int)) and len(stop) == 0
    if isinstance(stop, (str, int)):
        stop = [stop]
    temperature = get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not temperature >= 0):
        raise ValueError(f"sampling_params.temperature: must be >= 0 (0 = greedy decoding), got {temperature!r}")
    greedy = temperature is not None and temperature == 0
    if greedy:   # argmax; log-probs of the full softmax at temperature 1 (no top-k / top-p renormalisation)
        return _Sampling(api_types.SamplingParams(max_tokens=get("max_tokens"), temperature=1.0, top_k=0,
                                                  top_p=1.0, seed=get("seed"), stop=list(stop) if stop else None),
                         greedy=True, no_stop=no_stop)
    return _Sampling(api_types.SamplingParams(max_tokens=get("max_tokens"), temperature=temperature,
                                              top_k=get("top_k"), top_p=get("top_p"), seed=get("seed"),
                                              stop=list(stop) if stop else None), no_stop=no_stop)


@contextlib.contextmanager
def _sampler_for(sampler, sampling: _Sampling) -> Iterator[None]:
    """The sampler as one call's `sampling` needs it, restored after: no EOS stop for `stop=[]`, no min-p
    truncation for greedy decoding (whose log-probs are the full softmax's)."""
    eos, cfg = getattr(sampler, "eos_ids", None), sampler.cfg
    try:
        if sampling.no_stop and eos is not None:
            sampler.eos_ids = []
        if sampling.greedy and getattr(cfg, "min_p", 0.0):
            sampler.cfg = cfg.model_copy(update={"min_p": 0.0})
        yield
    finally:
        sampler.cfg = cfg
        if eos is not None:
            sampler.eos_ids = eos


def _async(name: str):
    async def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)
    call.__name__ = f"{name}_async"
    call.__doc__ = f"`{name}` for asyncio code (the call runs at once)."
    return call


# ------------------------------------------------------------------------------------------------ clients

class TrainingClient:
    """Tinker's TrainingClient over a covrl.api.TrainingClient (`.api`).

    Its sampling clients keep the weights they were created with for their whole life (the SDK's "snapshot"),
    also after later optim_step / load_state calls: nothing is copied while those are still the current
    weights; just before the weights change, the ones a live sampling client holds are frozen (LoRA: the
    adapters copied to CPU memory; a full fine-tune: the weights written under `<state folder>/sampler/held/`
    and read back on demand, `HELD_LOADED` of them kept loaded), and freed with the last client holding them.
    """

    def __init__(self, api: _ApiTrainingClient, base_model: str):
        self.api = api
        self.base_model = base_model
        self._current = _HeldWeights(api.version)   # the model's own weights, as sampling clients see them
        self._inflight: weakref.ref | None = None   # the shared target of the inflight sampling clients
        self._loaded: OrderedDict[str, list[torch.Tensor]] = OrderedDict()   # full fine-tunes: read back

    # -------------------------------------------------------------------- the weights sampling clients hold

    @property
    def _lora(self) -> bool:
        return hasattr(self.api.model, "peft_config")

    @contextlib.contextmanager
    def _changing_weights(self) -> Iterator[None]:
        """Around a call that changes the weights: the current ones are frozen first if a sampling client
        holds them; after it, sampling clients made from now on hold the new ones."""
        held = self._current
        if len(held.holders) and held.frozen is None and held.path is None:
            if self._lora:     # adapters: a few MB; kept in memory
                held.frozen = [p.detach().to("cpu", copy=True) for p in self.api.params]
            else:              # a whole model: on disk, read back when a client samples (LRU of HELD_LOADED)
                from safetensors.torch import save_file

                folder = self.api.state_dir / SNAPSHOT_DIR / "held"
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"v{held.version:06d}-{uuid.uuid4().hex[:8]}.safetensors"
                save_file({str(i): p.detach().contiguous().cpu() for i, p in enumerate(self.api.params)}, str(path))
                held.path = path
                weakref.finalize(held, path.unlink, missing_ok=True)   # freed with the last client
        try:
            yield
        finally:
            self._current = _HeldWeights(self.api.version)

    def _held_values(self, held: _HeldWeights) -> list[torch.Tensor]:
        if held.frozen is not None:
            return held.frozen
        key = str(held.path)
        if key not in self._loaded:
            from safetensors.torch import load_file

            state = load_file(key)
            self._loaded[key] = [state[str(i)] for i in range(len(state))]
            while len(self._loaded) > HELD_LOADED:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(key)
        return self._loaded[key]

    def _holding(self, held: _HeldWeights) -> contextlib.AbstractContextManager:
        """The model and its sampler hold `held`'s weights for the duration (the current weights: as they are;
        older ones: swapped in, and the trainable parameters restored bit for bit after)."""
        api = self.api
        if held is self._current:
            if held.version != api.version:   # covrl.api's optim_step called past this facade
                raise StaleSamplingClientError(
                    f"this sampling client holds weights version {held.version}, but the training client's "
                    f"weights were changed to version {api.version} past the Tinker facade")
            if api.sampler.version != api.version:   # a sampler with its own copy: push the current weights
                api.sampler.load_weights(api.model, api.version)
            return contextlib.nullcontext()
        return self._swapped(held)

    def _swapped(self, held: _HeldWeights) -> contextlib.AbstractContextManager:
        api, values = self.api, self._held_values(held)

        def load() -> None:
            for p, v in zip(api.params, values):
                p.copy_(v)

        return api.holding_while(load, held.version)

    def _inflight_target(self) -> _InflightTarget:
        target = self._inflight() if self._inflight is not None else None
        if target is None:
            target = _InflightTarget()
            self._inflight = weakref.ref(target)   # alive while an inflight client is
        return target

    def get_tokenizer(self):
        return self.api.tokenizer

    def get_info(self) -> dict[str, Any]:
        return {"model_name": self.base_model, "version": self.api.version,
                "lora": hasattr(self.api.model, "peft_config")}

    def _outputs(self, batch: TrainBatch, logprobs: torch.Tensor, token_loss: torch.Tensor | None):
        outs = []
        for i in range(len(batch)):
            n = int(batch.response_mask[i].sum())
            row = {"logprobs": TensorData.from_torch(logprobs[i, :n].cpu())}
            if token_loss is not None:
                row["elementwise_loss"] = TensorData.from_torch(token_loss[i, :n].cpu())
            outs.append(row)
        return outs

    def forward_backward(self, data: list, loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
                         ) -> APIFuture:
        name = _loss_name(loss_fn)
        batch = data_to_batch(data, name, self.api.tokenizer.pad_token_id or 0)
        # Tinker's sums: covrl.math losses named here keep their agg_mode default (token-mean)
        r = self.api.forward_backward(batch, name, loss_options=dict(loss_fn_config or {}))
        return APIFuture(ForwardBackwardOutput("ArrayRecord", self._outputs(batch, r.logprobs, r.token_loss),
                                               dict(r.metrics)))

    def forward(self, data: list, loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> APIFuture:
        """Per-token log-probs of the targets (no gradient, no loss)."""
        batch = data_to_batch(data, _loss_name(loss_fn) if loss_fn != "cross_entropy" else "cross_entropy",
                              self.api.tokenizer.pad_token_id or 0)
        f = self.api.forward(batch)
        return APIFuture(ForwardBackwardOutput("ArrayRecord", self._outputs(batch, f.logprobs, None), {}))

    def forward_backward_custom(self, data: list, loss_fn: Callable) -> APIFuture:
        """`loss_fn(data, logprobs: list[Tensor (N,)]) -> (loss, metrics)`, as Tinker's custom losses."""
        batch = data_to_batch(data, "cross_entropy", self.api.tokenizer.pad_token_id or 0)
        lengths = [int(n) for n in batch.response_mask.sum(1).tolist()]

        def fn(b, logprobs):
            return loss_fn(data, [logprobs[i, :n] for i, n in enumerate(lengths)])

        r = self.api.forward_backward_custom(batch, fn)
        return APIFuture(ForwardBackwardOutput("ArrayRecord", self._outputs(batch, r.logprobs, None), dict(r.metrics)))

    def optim_step(self, optim_params=None, *, adam_params=None) -> APIFuture:
        with self._changing_weights():
            r = self.api.optim_step(_adam(adam_params if adam_params is not None else optim_params))
        return APIFuture(OptimStepResponse(metrics=dict(r.metrics)))

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   **_: Any) -> APIFuture:
        """Weights, optimizer and version at `<state folder>/checkpoints/<name>/`. A name that holds a
        checkpoint already is refused (CheckpointExistsError) unless `overwrite=True`, as in the SDK."""
        _refuse_existing(self.api.state_dir / "checkpoints" / str(name), overwrite, "save_state")
        return APIFuture(SaveWeightsResponse(path=str(self.api.save_state(name))))

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture:
        """Weights only (Tinker's meaning); load_state_with_optimizer restores the optimizer too."""
        with self._changing_weights():
            self.api.load_state(path, optimizer=False)
        return APIFuture(LoadWeightsResponse(path=str(path)))

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None) -> APIFuture:
        with self._changing_weights():
            self.api.load_state(path, optimizer=True)
        return APIFuture(LoadWeightsResponse(path=str(path)))

    def save_weights_and_get_sampling_client(self, name: str | None = None, *, kind: str = "snapshot",
                                             **_: Any) -> SamplingClient:
        """A client of the current weights. `kind="snapshot"` (the SDK's default): it samples these weights
        for its whole life, whatever the training client does next. `kind="inflight"`: every inflight client
        of this training client samples the weights of its latest inflight save (newer ones, never older).
        `name` has no effect (deprecated in the SDK)."""
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind: 'snapshot' or 'inflight', got {kind!r}")
        if kind == "inflight":
            target = self._inflight_target()
            target.point(self._current)
            return SamplingClient(_HeldSamplingClient(self, target))
        return SamplingClient(_HeldSamplingClient(self, self._current))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                                 **_: Any) -> APIFuture:
        """A snapshot of the current weights (covrl.api's save_weights_for_sampler: adapters for LoRA, under
        the state folder), also pushed into the sampler; the path names it and its version
        (`covrl://sampler/<name>@<version>`) for create_sampling_client. A name already saved is refused
        (CheckpointExistsError) unless `overwrite=True` (a covrl addition: the SDK's call has no such option)."""
        _refuse_existing(self.api.state_dir / SNAPSHOT_DIR / "checkpoints" / str(name), overwrite,
                         "save_weights_for_sampler")
        self.api.save_weights_for_sampler(name)
        return APIFuture(SaveWeightsForSamplerResponse(path=f"covrl://sampler/{name}@{self.api.version}"))

    def create_sampling_client(self, model_path: str, **_: Any) -> SamplingClient:
        """A client of the snapshot `model_path` names: it samples that version's weights, also after newer
        ones were pushed."""
        if not isinstance(model_path, str) or not model_path.startswith("covrl://sampler/") or "@" not in model_path:
            raise ValueError(f"model_path: expected a path from save_weights_for_sampler, got {model_path!r}")
        name, version = model_path[len("covrl://sampler/"):].rsplit("@", 1)
        try:
            client = self.api.create_sampling_client(name)
        except CheckpointError as err:
            raise ValueError(f"model_path {model_path!r}: no snapshot {name!r} ({err})") from None
        if str(client.version) != version:
            raise ValueError(f"model_path {model_path!r}: the snapshot {name!r} now holds version "
                             f"{client.version} (saved again under the same name)")
        return SamplingClient(client)

    forward_async = _async("forward")
    forward_backward_async = _async("forward_backward")
    forward_backward_custom_async = _async("forward_backward_custom")
    optim_step_async = _async("optim_step")
    save_state_async = _async("save_state")
    load_state_async = _async("load_state")
    load_state_with_optimizer_async = _async("load_state_with_optimizer")
    save_weights_for_sampler_async = _async("save_weights_for_sampler")
    save_weights_and_get_sampling_client_async = _async("save_weights_and_get_sampling_client")
    create_sampling_client_async = _async("create_sampling_client")


@dataclass(eq=False)
class _HeldWeights:
    """The weights (version `version`) a training client had while sampling clients were made of them:
    the model's own while they are current, then `frozen` (LoRA adapters, CPU) or at `path` (a full model,
    on disk). `holders`: the sampling clients (and inflight targets) that hold them."""
    version: int
    frozen: list[torch.Tensor] | None = None
    path: Path | None = None
    holders: weakref.WeakSet = field(default_factory=weakref.WeakSet)


class _InflightTarget:
    """The mutable weights the inflight sampling clients of one training client share: each inflight save
    points it at the weights of that moment."""

    def __init__(self):
        self.held: _HeldWeights | None = None

    def point(self, held: _HeldWeights) -> None:
        if self.held is not None:
            self.held.holders.discard(self)
        self.held = held
        held.holders.add(self)


class _HeldSamplingClient(_ApiSamplingClient):
    """A covrl.api SamplingClient that samples the weights it holds (`_HeldWeights`, or an inflight target's)
    whatever its training client did since: it never goes stale."""

    def __init__(self, trainer: TrainingClient, target: _HeldWeights | _InflightTarget):
        self._trainer, self._target = trainer, target
        if isinstance(target, _HeldWeights):
            target.holders.add(self)
        super().__init__(trainer.api, self._held().version)

    def _held(self) -> _HeldWeights:
        return self._target if isinstance(self._target, _HeldWeights) else self._target.held

    @property
    def version(self) -> int:   # the held weights' (an inflight client's moves with its target)
        return self._held().version

    @version.setter
    def version(self, value: int) -> None:   # covrl.api's __init__ sets it; the held weights decide
        pass

    def _check_fresh(self) -> None:
        return None

    def _weights_held(self) -> contextlib.AbstractContextManager:
        return self._trainer._holding(self._held())


def _refuse_existing(folder: Path, overwrite: bool, call: str) -> None:
    if not overwrite and (folder / "COMPLETE").is_file():
        raise CheckpointExistsError(f"{call}: a checkpoint named {folder.name!r} already exists ({folder}); "
                                    "save under a new name, or pass overwrite=True to replace it")


class SamplingClient:
    """Tinker's SamplingClient over a covrl.api.SamplingClient (`.api`, bound to one weights version)."""

    def __init__(self, api: _ApiSamplingClient):
        self.api = api

    def result(self, timeout: float | None = None) -> SamplingClient:   # the SDK's "backcompat future" use
        return self

    def get_tokenizer(self):
        return self.api.get_tokenizer()

    def sample(self, prompt, num_samples: int, sampling_params=None, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0, **unsupported: Any) -> APIFuture:
        if include_prompt_logprobs or topk_prompt_logprobs or topk_sample_logprobs:
            raise ValueError("include_prompt_logprobs / topk_prompt_logprobs / topk_sample_logprobs: not supported "
                             "here (use compute_logprobs for the prompt's log-probs)")
        given = [k for k, v in unsupported.items() if v not in (None, 0, False)]
        if given:
            raise ValueError(f"{given}: not supported here")
        sampling = _sampling(sampling_params)
        with _sampler_for(self.api.owner.sampler, sampling):
            r = self.api.sample(_ints(prompt, "prompt"), num_samples, sampling.params, greedy=sampling.greedy)
        # stop=[]: nothing stops a sample, so each ran to max_tokens (an EOS among its tokens included)
        return APIFuture(SampleResponse([SampledSequence("length" if sampling.no_stop else s.stop_reason, s.tokens,
                                                         s.logprobs) for s in r.sequences]))

    def compute_logprobs(self, prompt, prompt_logprobs_last_n: int | None = None) -> APIFuture:
        """log p of each prompt token given the ones before (None for the first), at temperature 1."""
        self.api._check_fresh()
        tokens = _ints(prompt, "prompt")
        if len(tokens) < 2:
            return APIFuture([None] * len(tokens))
        owner = self.api.owner
        batch = TrainBatch.from_sequences([tokens[:1]], [tokens[1:]])
        temperature, owner.temperature = owner.temperature, 1.0
        try:
            with self.api._weights_held():    # a snapshot's client scores with the snapshot's weights
                lp = owner.forward(batch).logprobs[0].tolist()
        finally:
            owner.temperature = temperature
        return APIFuture([None, *lp])

    sample_async = _async("sample")
    compute_logprobs_async = _async("compute_logprobs")


class ServiceClient:
    """Creates the clients. `config` (covrl addition): the covrl config or preset the models come from (task,
    sampler, warm-up, seed); `overrides` dotted overrides of it. No network, no API key. `share_base` (covrl
    addition): LoRA clients of one base model (same config and seed) share its weights in memory, each with its
    own adapters (covrl.api.multilora); False builds a model of its own for each."""

    def __init__(self, config=None, overrides: Mapping[str, Any] | None = None, *, warmup: bool = True,
                 state_dir: str | None = None, share_base: bool = True, **_: Any):
        # no config given (a recipe's own `ServiceClient(base_url=...)`): $COVRL_TINKER_CONFIG, else the preset
        # of the model each client names (tiny for "tiny", the default SmolLM2 run otherwise)
        self._named = config or os.environ.get("COVRL_TINKER_CONFIG")
        self._overrides = overrides
        self.config = resolve_config(self._named or "tiny", overrides)
        self.warmup = warmup
        self.state_dir = state_dir
        # LoRA clients of one base model share its weights (covrl.api.multilora); scoped() copies keep this one
        # registry, so a server's tenants share them too (read-only: the base weights are frozen)
        self.share_base = share_base
        self._bases = SharedBases()
        self._training_clients: list[TrainingClient] = []   # newest last: they own the covrl://sampler/ paths
        self._restored: dict[Path, TrainingClient] = {}     # client folder -> a client sampling its snapshots

    def scoped(self, state_dir: str | Path) -> ServiceClient:
        """A ServiceClient with this one's config and settings that keeps its clients' folders under `state_dir`
        and knows only the clients it creates (`covrl serve` gives each tenant one, so no tenant reaches
        another's clients or snapshots through it)."""
        other = copy.copy(self)
        other.state_dir, other._training_clients, other._restored = str(state_dir), [], {}
        return other

    def forget(self, client: TrainingClient) -> None:
        """Drop this ServiceClient's reference to `client` (a server releasing an ended session's clients), so
        its model is freed once no one else holds it."""
        self._training_clients = [c for c in self._training_clients if c is not client]
        self._restored = {k: c for k, c in self._restored.items() if c is not client}

    @staticmethod
    def is_model_folder(base_model: str) -> bool:
        """Whether `base_model` is read from a local transformers folder rather than a model covrl knows by name."""
        return ServiceClient._model_section(base_model)["source"] == "hf"

    @staticmethod
    def _model_section(base_model: str) -> dict[str, Any]:
        if base_model in ("tiny", "smollm2") or "smollm2-135m" in base_model.lower():
            return {"source": "smollm2" if base_model != "tiny" else "tiny", "path": None}
        return {"source": "hf", "path": base_model}

    def _client(self, base_model: str, lora: LoraConfig | None, seed: int | None) -> TrainingClient:
        if not isinstance(base_model, str) or not base_model:
            raise ValueError(f"base_model: a model name is needed, got {base_model!r}")
        base = self.base_config(base_model)
        model = base.model.model_copy(update={**self._model_section(base_model), "lora": lora})
        run = base.run if seed is None else base.run.model_copy(update={"seed": int(seed)})
        cfg = base.model_copy(update={"model": model, "run": run})
        folder = self._client_folder(base_model)
        (folder / CLIENT_FILE).write_text(json.dumps({"base_model": base_model, "seed": seed,
                                                      "lora": None if lora is None else lora.model_dump()}))
        if lora is not None and self.share_base:   # one copy of the base weights for all its LoRA clients
            api = lora_client(self._bases.get(cfg, warmup=self.warmup), lora, state_dir=folder)
        else:
            api = _ApiTrainingClient.from_config(cfg, warmup=self.warmup, lora_after_warmup=True, state_dir=folder)
        client = TrainingClient(api, base_model)
        self._training_clients.append(client)
        return client

    def base_config(self, base_model: str):
        """The config a client of `base_model` is built from: the one given (or $COVRL_TINKER_CONFIG), else the
        tiny preset for "tiny" and the default SmolLM2 run for any other model."""
        if self._named or base_model == "tiny":
            return self.config
        return resolve_config("default", self._overrides)

    def _client_folder(self, base_model: str) -> Path:
        """A folder of its own for each training client (its states and snapshots): two clients, or two runs
        of a recipe with different log folders, never write into each other's checkpoints."""
        root = Path(self.state_dir or Path(self.config.run.output_dir) / "tinker")
        root.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in Path(base_model).name)[:40]
        return Path(tempfile.mkdtemp(prefix=f"{slug}-", dir=root))

    def create_training_client_from_state(self, path: str, user_metadata: Any = None) -> TrainingClient:
        """A training client of the model a `save_state` path holds (its base model and LoRA settings as they
        were created), with those weights; the optimizer starts fresh (Tinker's meaning)."""
        return self._from_state(path, optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str, user_metadata: Any = None
                                                         ) -> TrainingClient:
        """`create_training_client_from_state` with the optimizer state (moments, step count) restored too."""
        return self._from_state(path, optimizer=True)

    def _from_state(self, path: str, *, optimizer: bool) -> TrainingClient:
        state = Path(path)
        meta = state.parent.parent / CLIENT_FILE     # <client folder>/checkpoints/<name>
        if not state.is_dir() or not meta.is_file():
            raise ValueError(f"path {path!r}: not a state a training client of the facade saved (save_state "
                             f"returns such paths; {meta} is missing)")
        info = json.loads(meta.read_text())
        lora = None if info["lora"] is None else LoraConfig(**info["lora"])
        client = self._client(info["base_model"], lora, info["seed"])
        with client._changing_weights():   # its sampling clients then hold the loaded version, not version 0
            client.api.load_state(state, optimizer=optimizer)
        return client

    def create_sampling_client(self, base_model: str | None = None, model_path: str | None = None,
                               **_: Any) -> SamplingClient:
        """A client to sample from or score with (e.g. a distillation teacher's `compute_logprobs`):
        `model_path` a `covrl://sampler/<name>@<version>` path that a training client of this ServiceClient
        saved (`save_weights_for_sampler`) or the folder of such a snapshot
        (`<client folder>/sampler/checkpoints/<name>`, also one an earlier process saved), else the model
        `base_model` names (as for training clients: a known model or a local transformers folder, built as
        this ServiceClient builds them)."""
        if model_path is not None and Path(model_path).is_dir():
            return self._snapshot_client(Path(model_path))
        if model_path is not None:
            for owner in reversed(self._training_clients):
                try:
                    return owner.create_sampling_client(model_path)
                except ValueError:
                    continue
            raise ValueError(f"model_path {model_path!r}: no training client of this ServiceClient saved it "
                             "(save_weights_for_sampler returns such paths)")
        if base_model is None:
            raise ValueError("create_sampling_client: give base_model or model_path")
        return self._client(base_model, None, None).save_weights_and_get_sampling_client()

    def _snapshot_client(self, folder: Path) -> SamplingClient:
        """A client of the snapshot at `folder`: sampled by the training client that saved it when this
        ServiceClient holds it, else by one built (once per client folder) from its tinker_client.json."""
        client_folder = folder.resolve().parents[2]    # <client folder>/sampler/checkpoints/<name>
        meta = client_folder / CLIENT_FILE
        if folder.resolve().parent.parent.name != SNAPSHOT_DIR or not meta.is_file():
            raise ValueError(f"model_path {str(folder)!r}: not a snapshot that save_weights_for_sampler wrote "
                             f"({meta} is missing)")
        owner = next((c for c in reversed(self._training_clients)
                      if c.api.state_dir.resolve() == client_folder), None)
        if owner is None:
            owner = self._restored.get(client_folder)
        if owner is None:
            info = json.loads(meta.read_text())
            lora = None if info["lora"] is None else LoraConfig(**info["lora"])
            owner = self._restored[client_folder] = self._client(info["base_model"], lora, info["seed"])
        try:
            return SamplingClient(owner.api.create_sampling_client(folder))
        except CheckpointError as err:
            raise ValueError(f"model_path {str(folder)!r}: {err}") from None

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    **_: Any) -> TrainingClient:
        """LoRA adapters of `rank` on the attention and/or MLP projections (covrl's LoRA adapts linear
        layers: `train_unembed` is accepted and has no effect)."""
        targets = (_ATTN if train_attn else []) + (_MLP if train_mlp else [])
        if not targets:
            raise ValueError("train_mlp / train_attn: at least one of them must be True")
        return self._client(base_model, LoraConfig(rank=rank, target_modules=targets), seed)

    def create_training_client(self, base_model: str, seed: int | None = None) -> TrainingClient:
        """covrl addition: a full fine-tune of `base_model` (every weight trained)."""
        return self._client(base_model, None, seed)

    def get_server_capabilities(self) -> dict[str, Any]:
        return {"supported_models": ["tiny", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                     "<a local transformers folder>"],
                "loss_fns": sorted({*(n for n in API_LOSSES if not n.startswith("tinker_")), *_TINKER_NAMES})}

    create_training_client_from_state_async = _async("create_training_client_from_state")
    create_training_client_from_state_with_optimizer_async = _async("create_training_client_from_state_with_optimizer")
    create_lora_training_client_async = _async("create_lora_training_client")
    create_training_client_async = _async("create_training_client")
    create_sampling_client_async = _async("create_sampling_client")


__all__ = ["APIFuture", "AdamParams", "CheckpointExistsError", "Datum", "EncodedTextChunk", "ForwardBackwardOutput",
           "ImageAssetPointerChunk", "ImageChunk", "LoadWeightsResponse", "ModelInput", "ModelInputChunk",
           "OptimStepResponse", "SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams", "SaveWeightsForSamplerResponse",
           "SaveWeightsResponse", "ServiceClient", "StaleSamplingClientError", "StopReason", "TensorData",
           "TinkerError", "TrainingClient", "data_to_batch", "install_as_tinker", "types"]


def main(argv: list[str] | None = None) -> int:
    """`python -m covrl.api.tinker SCRIPT [ARGS...]`: run a script written for Tinker's SDK against this
    facade (`import tinker` resolves here)."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m covrl.api.tinker SCRIPT.py [ARGS...]  (runs SCRIPT with `import tinker` = covrl's "
              "local facade)")
        return 0 if argv else 2
    from covrl.api import tinker as facade  # the package module, not this file run as __main__

    facade.install_as_tinker()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
