"""Sampler pools: typed, validated, loadable from a TOML `[[pools]]` table list.

A pool is a set of identical GPUs serving the policy at one precision in one region. Impossible
pools are refused at load time with a pydantic ValidationError whose location is the offending
field and whose message names the pool.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hardware.catalog import CATALOG, GpuSpec, canonical_gpu
from hardware.placement import SGLangLaunch

__all__ = ["DEFAULT_ROLLOUTS_PER_GPU", "HardwareConfig", "PoolConfig", "PoolList", "check_devices"]

DEFAULT_ROLLOUTS_PER_GPU = 64
"""Concurrent rollouts per GPU when a pool does not say (a typical decode batch per GPU)."""


def _who(info: ValidationInfo) -> str:
    name = info.data.get("name")
    return f"pool {name!r}" if name else "pool"


class PoolConfig(BaseModel):
    """One sampler pool. Nested as `pools: PoolList` in the run config."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """Unique pool name; appears in traces, the cost report and each rollout's `pool`."""
    gpu: str
    """GPU type from the catalog (`A100-80GB`, `H100-SXM`, `H200`, `B200`, `L40S`, `cpu`);
    aliases such as `h100` are accepted and stored canonical."""
    count: int = 1
    """Number of GPUs in the pool (≥ 1)."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Weight precision the pool serves; `fp8` needs a GPU with FP8 arithmetic."""
    price_per_gpu_hour: float | None = None
    """USD per GPU-hour; None takes the catalog's typical on-demand price."""
    region: str = "local"
    """Where the pool runs (free text: a cloud region, `local`); shown in reports."""
    device: Literal["cpu", "cuda"] | None = None
    """`cuda` runs on real GPUs; `cpu` emulates the pool on this machine (priced and modelled
    as `gpu`). None: `cpu` for gpu `cpu`, else `cuda`."""
    staleness_budget: int = 2
    """Most versions this pool's weights may lag the trainer and still start rollouts (≥ 0);
    trajectories staler than this at train time are dropped."""
    max_concurrent_rollouts: int | None = None
    """Most rollouts in flight on the pool at once (≥ 1); None means 64 per GPU."""
    backend: Literal["torch", "sglang"] = "torch"
    """What generates: `torch` (Flotilla's own engine, CPU or CUDA) or `sglang` (an SGLang
    server per GPU, given by `urls` or started by `launch`; needs device `cuda`)."""
    urls: list[str] | None = None
    """sglang: base URLs of running servers, one per GPU (`count` of them), e.g.
    `["http://10.0.0.7:30000"]`; rank r talks to `urls[r]`."""
    launch: SGLangLaunch | None = None
    """sglang: start one server per GPU instead (`{ model_path = ..., args = [...] }`);
    each is health-checked before the run starts and stopped with the run."""
    weights_dir: str | None = None
    """sglang: a directory the servers can read, where weight updates are written as
    safetensors for `/update_weights_from_disk`; None: a temporary directory beside each
    sampler (right when the server runs on the sampler's machine)."""
    hosts: list[str] = Field(default_factory=list)
    """`flotilla host` addresses (`tcp://10.0.0.5:5555`) that run this pool's samplers, ranks
    spread round-robin; empty: samplers run on the controller's machine."""
    keys: str = "~/.flotilla/keys"
    """With `hosts`: the controller's CurveZMQ key directory (`id.key_secret`; each host's
    public key in `hosts/<ip>_<port>.key`, else the controller's own when all machines share
    one key pair -- those hosts run with `--trust-own-key`)."""
    elastic: bool = False
    """Hosts may join and leave during the run: one sampler per host, up to `max_hosts`; a
    host of `hosts` or `hosts_file` that answers (and accepts the controller's key) joins,
    gets a keyframe and takes work; one that leaves or stays unreachable for `[faults]
    host_give_up_after_s` frees its place. False: `hosts` are fixed and must all answer."""
    min_hosts: int = 0
    """elastic: how many of `hosts` must answer at start-up (the others join when they do)."""
    max_hosts: int | None = None
    """elastic: most hosts at once; None: the number of `hosts` (at least 1)."""
    hosts_file: str | None = None
    """elastic: a file the controller reads every second, one `tcp://HOST:PORT` per line
    (`#` comments); each host listed joins when it answers. Removing a line does not remove
    a host: stop `flotilla host` (SIGTERM) to take one out."""
    prefix_cache: bool = True
    """torch backend: keep a session's KV cache between its turns (a harness episode's
    requests all go to one rank), so a turn prefills only the tokens past the cached
    prefix; false recomputes the whole context at every turn."""
    stale_prefix: Literal["reuse", "recompute"] = "reuse"
    """torch backend, a cached prefix older than the weights now held (a weight update came
    between two turns): `reuse` its keys and values as computed (every generated token still
    records the version that produced it) or `recompute` it under the new weights."""
    emulate_quant: Literal["e5m2_tensor", "int4_group", "int3_group", "int2_group"] | None = None
    """torch backend: round every linear weight the sampler multiplies with through a coarser
    format on top of `precision` (`e5m2_tensor`: FP8 e5m2 with one scale per tensor;
    `int4_group`: 4-bit integers, one scale per 32 columns; `int3_group`, `int2_group`: 3 and
    2 bits, coarser than any real pool) -- a deliberately coarse pool to
    measure how training copes with sampler mismatch. It changes numerics only, not speed or
    price; None: the weights as `precision` delivers them."""
    gpus: list[int] | None = None
    """device `cuda`: the CUDA device index of each rank (`count` of them; rank r uses
    `gpus[r]`); None: each rank takes the next GPU of its own machine (with n hosts, rank r
    is on host r mod n and takes GPU r // n)."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str, info: ValidationInfo) -> str:
        canon = canonical_gpu(v)
        if canon is None:
            raise ValueError(f"{_who(info)}: unknown GPU {v!r}; known: {', '.join(CATALOG)}")
        return canon

    @field_validator("count")
    @classmethod
    def _positive_count(cls, v: int, info: ValidationInfo) -> int:
        if v <= 0:
            raise ValueError(f"{_who(info)}: count must be ≥ 1, got {v}")
        return v

    @field_validator("precision")
    @classmethod
    def _precision_supported(cls, v: str, info: ValidationInfo) -> str:
        gpu = info.data.get("gpu")
        if v == "fp8" and gpu is not None and not CATALOG[gpu].has_fp8:
            raise ValueError(f"{_who(info)}: precision 'fp8' needs FP8 arithmetic, which {gpu} lacks")
        return v

    @field_validator("price_per_gpu_hour")
    @classmethod
    def _non_negative_price(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and not v >= 0.0:  # also refuses NaN
            raise ValueError(f"{_who(info)}: price_per_gpu_hour must be ≥ 0, got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _device_matches(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v == "cuda" and info.data.get("gpu") == "cpu":
            raise ValueError(f"{_who(info)}: device 'cuda' with gpu 'cpu'; use device 'cpu' or a GPU type")
        return v

    @field_validator("staleness_budget")
    @classmethod
    def _non_negative_budget(cls, v: int, info: ValidationInfo) -> int:
        if v < 0:
            raise ValueError(f"{_who(info)}: staleness_budget must be ≥ 0, got {v}")
        return v

    @field_validator("max_concurrent_rollouts")
    @classmethod
    def _positive_rollouts(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"{_who(info)}: max_concurrent_rollouts must be ≥ 1, got {v}")
        return v

    @field_validator("hosts")
    @classmethod
    def _tcp_hosts(cls, v: list[str], info: ValidationInfo) -> list[str]:
        for h in v:
            _, sep, port = h.removeprefix("tcp://").rpartition(":")
            if not h.startswith("tcp://") or not sep or not port.isdigit():
                raise ValueError(f"{_who(info)}: host {h!r} is not tcp://HOST:PORT")
        return v

    @model_validator(mode="after")
    def _backend_fields(self) -> PoolConfig:
        who = f"pool {self.name!r}"
        if self.backend == "sglang":
            if (self.urls is None) == (self.launch is None):
                raise ValueError(
                    f"{who}: backend 'sglang' needs exactly one of urls (running servers) and launch (start them)"
                )
            if self.urls is not None and len(self.urls) != self.count:
                raise ValueError(f"{who}: urls lists {len(self.urls)} servers for count {self.count} (one per GPU)")
            if self.urls is not None and not all(u.startswith(("http://", "https://")) for u in self.urls):
                raise ValueError(f"{who}: urls must be http:// or https:// base URLs")
            if self.device == "cpu" or self.gpu == "cpu":
                raise ValueError(f"{who}: backend 'sglang' runs on CUDA GPUs; device must be 'cuda'")
            if self.emulate_quant is not None:
                raise ValueError(f"{who}: emulate_quant is a torch-backend setting")
            if not self.prefix_cache or self.stale_prefix != "reuse":
                raise ValueError(
                    f"{who}: prefix_cache and stale_prefix are torch-backend settings "
                    "(an SGLang server keeps its own prefix cache)"
                )
        elif self.urls is not None or self.launch is not None or self.weights_dir is not None:
            raise ValueError(
                f"{who}: urls, launch and weights_dir belong to backend 'sglang' "
                f"(this pool's backend is {self.backend!r})"
            )
        if self.elastic:
            cuda = (self.device or ("cpu" if self.gpu == "cpu" else "cuda")) == "cuda"
            if self.backend != "torch" or (cuda and self.count != 1):
                raise ValueError(f"{who}: an elastic pool runs one torch sampler per host (count = 1 GPU per host)")
            if self.max_hosts is None:
                self.max_hosts = max(1, len(self.hosts))
            if self.max_hosts < max(1, len(self.hosts)) or not 0 <= self.min_hosts <= len(self.hosts):
                raise ValueError(
                    f"{who}: elastic needs 0 <= min_hosts <= len(hosts) <= max_hosts and max_hosts >= 1 "
                    f"(got min_hosts {self.min_hosts}, {len(self.hosts)} hosts, max_hosts {self.max_hosts})"
                )
        elif self.min_hosts or self.max_hosts is not None or self.hosts_file is not None:
            raise ValueError(f"{who}: min_hosts, max_hosts and hosts_file are for elastic pools (elastic = true)")
        if self.gpus is not None:
            if self.device == "cpu" or self.gpu == "cpu":
                raise ValueError(f"{who}: gpus is for device 'cuda' pools")
            if len(self.gpus) != self.count or any(g < 0 for g in self.gpus):
                raise ValueError(
                    f"{who}: gpus must list {self.count} device indices ≥ 0 (one per rank), got {self.gpus}"
                )
        return self

    @model_validator(mode="after")
    def _fill_defaults(self) -> PoolConfig:
        # Filled in here (not left None) so the resolved config saved with a run shows the
        # numbers that were actually used.
        if self.price_per_gpu_hour is None:
            self.price_per_gpu_hour = CATALOG[self.gpu].price_per_hour
        if self.device is None:
            self.device = "cpu" if self.gpu == "cpu" else "cuda"
        if self.max_concurrent_rollouts is None:
            self.max_concurrent_rollouts = DEFAULT_ROLLOUTS_PER_GPU * self.count
        return self

    @property
    def spec(self) -> GpuSpec:
        """The catalog entry of this pool's GPU type."""
        return CATALOG[self.gpu]

    @property
    def price(self) -> float:
        """USD per GPU-hour (resolved)."""
        assert self.price_per_gpu_hour is not None
        return self.price_per_gpu_hour

    @property
    def capacity(self) -> int:
        """Most rollouts in flight at once (resolved `max_concurrent_rollouts`)."""
        assert self.max_concurrent_rollouts is not None
        return self.max_concurrent_rollouts

    @property
    def emulated(self) -> bool:
        """True when a GPU pool is emulated on this machine's CPU."""
        return self.device == "cpu" and self.gpu != "cpu"


def _unique_names(pools: list[PoolConfig]) -> list[PoolConfig]:
    seen: dict[str, int] = {}
    for i, p in enumerate(pools):
        if p.name in seen:
            raise ValueError(f"duplicate pool name {p.name!r} at positions {seen[p.name]} and {i}")
        seen[p.name] = i
    return pools


PoolList = Annotated[list[PoolConfig], AfterValidator(_unique_names)]
"""A list of pools with unique names: use as `pools: PoolList` in a config model."""


class HardwareConfig(BaseModel):
    """The pools of a run (the `[[pools]]` tables of its TOML)."""

    model_config = ConfigDict(extra="forbid")

    pools: PoolList = Field(min_length=1)
    """Sampler pools; names must be unique."""

    def pool(self, name: str) -> PoolConfig:
        """The pool called `name`; KeyError naming the known pools otherwise."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool {name!r}; pools: {', '.join(p.name for p in self.pools)}")

    @classmethod
    def from_toml_text(cls, text: str) -> HardwareConfig:
        """Parse TOML text and validate its `[[pools]]`; other top-level tables are ignored."""
        data: dict[str, Any] = tomllib.loads(text)
        return cls.model_validate({"pools": data.get("pools", [])})

    @classmethod
    def from_toml(cls, path: str | Path) -> HardwareConfig:
        """Read a TOML file (a run config or a pools-only file) and validate its `[[pools]]`."""
        return cls.from_toml_text(Path(path).read_text())


def check_devices(pools: list[PoolConfig], cuda_devices: int) -> None:
    """Refuse pools this machine cannot run: a `cuda` pool when it has `cuda_devices` == 0
    CUDA GPUs (a pool placed on remote hosts, or an SGLang pool that connects to running
    servers, is not checked here). Raises ValueError
    naming the pool's index and field; the caller says how many GPUs it sees (the
    registry itself never imports torch)."""
    for i, p in enumerate(pools):
        remote = p.hosts or (p.backend == "sglang" and p.urls)  # its GPUs are on other machines
        if p.device == "cuda" and cuda_devices == 0 and not remote:
            how = "set" if "device" in p.model_fields_set else f"the default for gpu {p.gpu!r}"
            raise ValueError(
                f"pools.{i}.device: pool {p.name!r} needs CUDA (device 'cuda', {how}) but this "
                f"machine has no CUDA GPU; use device = \"cpu\" to emulate the pool here"
            )
