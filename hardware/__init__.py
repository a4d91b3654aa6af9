"""GPU catalog, sampler pools, throughput model, cost-aware scheduling and cost reports.

Pure Python + pydantic: importing `hardware` imports nothing else of Flotilla's and no torch.

    hw = HardwareConfig.from_toml("run.toml")                   # [[pools]] -> validated pools
    tp = ThroughputModel(hw.pools, ModelSpec(total_params=35e9, active_params=3e9))
    sched = Scheduler(hw.pools, tp)                              # cost-aware placement
    sched.set_trainer(version, demand, horizon_s, consume_per_s, batch); pool = sched.place()  # None: wait
    sched.complete(pool, tokens); sched.set_pool_version(pool, v); sched.observe(pool, tokens, gpu_s)
    ledger = CostLedger(hw.pools, throughput=tp); ledger.record_busy(...); ledger.record_rollout(...)
    ledger.report().write(run_dir)                               # cost_report.json + .md
    ckpt = {"ledger": ledger.state(), "scheduler": sched.state()}  # JSON; resume with load_state
    ScaleSim(pools, batch=..., step_seconds=..., steps=..., rollout_tokens=...).run()  # fleet at scale
"""

from hardware.catalog import CATALOG, SOURCES, GpuSpec, canonical_gpu, catalog_markdown, gpu_spec
from hardware.describe import describe, model_spec_from_table
from hardware.fleetscale import ScalePool, ScalePoolStats, ScaleResult, ScaleSim, ScaleStep
from hardware.ledger import CostLedger, CostReport, CostTotals, Counterfactual, PoolCost
from hardware.placement import SGLangLaunch, detected_gpu, gpu_mismatch
from hardware.pools import DEFAULT_ROLLOUTS_PER_GPU, HardwareConfig, PoolConfig, PoolList, check_devices
from hardware.providers import OFFERS, PROVIDER_SOURCES, Offer, offers_markdown
from hardware.scheduler import PoolState, Scheduler
from hardware.simulate import FleetSim, SimPlacement, SimPoolStats, SimResult
from hardware.throughput import (
    ModelSpec,
    RooflineAssumptions,
    ThroughputModel,
    bytes_per_param,
    decode_step_seconds,
    fit_batch_per_gpu,
    replica_gpus,
    roofline_tokens_per_s,
)

__all__ = [
    "CATALOG",
    "DEFAULT_ROLLOUTS_PER_GPU",
    "OFFERS",
    "PROVIDER_SOURCES",
    "SOURCES",
    "CostLedger",
    "CostReport",
    "CostTotals",
    "Counterfactual",
    "FleetSim",
    "GpuSpec",
    "HardwareConfig",
    "ModelSpec",
    "Offer",
    "PoolConfig",
    "PoolCost",
    "PoolList",
    "PoolState",
    "RooflineAssumptions",
    "SGLangLaunch",
    "ScalePool",
    "ScalePoolStats",
    "ScaleResult",
    "ScaleSim",
    "ScaleStep",
    "Scheduler",
    "SimPlacement",
    "SimPoolStats",
    "SimResult",
    "ThroughputModel",
    "bytes_per_param",
    "canonical_gpu",
    "catalog_markdown",
    "check_devices",
    "decode_step_seconds",
    "describe",
    "detected_gpu",
    "fit_batch_per_gpu",
    "gpu_mismatch",
    "gpu_spec",
    "model_spec_from_table",
    "offers_markdown",
    "replica_gpus",
    "roofline_tokens_per_s",
]
