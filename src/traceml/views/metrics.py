"""Prometheus: a live run's figures in the exposition format, labelled by rank, read from the
collector's live state at each scrape (prometheus-client renders them). This is how a cluster's
Prometheus and Grafana pick a run up: scrape `/metrics` on the dashboard's port, or on
`traceml run --metrics-port P`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, TypedDict

from traceml.analysis.hardware import device_peak_tflops
from traceml.analysis.ledger import part_bytes
from traceml.analysis.rollup import Window, percentile
from traceml.records import ALL_PHASES, LayerReport, RankHello, StepRecord
from traceml.report.queries import MEMORY_COLUMNS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily, Metric

    from traceml.report.live import Collector, LiveState

QUANTILES = (0.5, 0.9, 0.99)


class LiveMetrics:
    """A prometheus-client collector over the run's collector: each scrape reads its state."""

    def __init__(self, collector: Collector, live_state: Callable[[], LiveState]):
        self.collector = collector
        self.live_state = live_state  # the shared, rate-limited live snapshot (its findings)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        step_time = _gauge("step_time_ms", "Step time over the recent steps, by quantile", "rank", "quantile")
        phase_share = _gauge("phase_share", "Share of the recent steps' time in each phase", "rank", "phase")
        memory = _gauge("memory_bytes", "Memory at the latest step", "rank", "kind")
        steps_per_s = _gauge("steps_per_second", "Steps a second over the recent steps", "rank")
        samples_per_s = _gauge("samples_per_second", "Samples a second over the recent steps", "rank")
        tokens_per_s = _gauge("tokens_per_second", "Real tokens (attention_mask) a second over the recent steps",
                              "rank")
        mfu = _gauge("mfu", "Model FLOPs utilization (deep-dive FLOPs a step, known device peak)", "rank")
        comm_wait = _gauge("comm_wait_share", "Share of the recent steps' time spent waiting in collectives, "
                           "inside forward and backward (DDP, FSDP)", "rank")
        steps_total = CounterMetricFamily("traceml_steps", "Steps recorded", labels=["rank"])
        findings = _gauge("finding_active", "A live finding (1 while it holds)", "kind", "severity", "rank")
        state = self.live_state()
        hellos = self.collector.latest(RankHello)
        name: str  # a phase's, then a memory field's
        for rank, records in self.collector.kept_by(StepRecord).items():
            if not records:
                continue
            label = str(rank)
            # One rank's own steps make a Window: the statistics every view reads.
            window = Window(records)
            for q in QUANTILES:
                step_time.add_metric([label, str(q)], percentile(window.step_times_ms, q))
            for name in ALL_PHASES:
                phase_share.add_metric([label, name], window.phases[name].share)
            latest = records[-1]
            if latest.comm_wait_ms is not None:
                comm_wait.add_metric([label], window.comm_wait.share)
            for name in MEMORY_COLUMNS:
                value = getattr(latest, name)
                if value is not None:
                    memory.add_metric([label, name[:-len("_bytes")]], value)
            steps_per_s.add_metric([label], window.steps_per_s)
            samples_per_s.add_metric([label], window.samples_per_s or 0.0)
            if window.tokens_per_s is not None:
                tokens_per_s.add_metric([label], window.tokens_per_s)
            steps_total.add_metric([label], latest.step + 1)
            utilization = _mfu(state.layers, hellos.get(rank), window.steps_per_s)
            if utilization is not None:
                mfu.add_metric([label], utilization)
        for finding in state.findings:
            findings.add_metric([finding.kind, finding.severity,
                                 "" if finding.rank is None else str(finding.rank)], 1.0)
        goodput_share = _gauge("goodput_share", "Share of the run's wall time so far in each part (training is "
                               "the goodput)", "part")
        goodput_seconds = _gauge("goodput_seconds", "The run's wall time so far in each part, seconds (mean over "
                                 "ranks)", "part")
        for part, figures in (state.goodput.parts.items() if state.goodput is not None else ()):
            goodput_share.add_metric([part], figures["share"])
            goodput_seconds.add_metric([part], figures["seconds"])
        ledger = _gauge("memory_ledger_bytes", "What holds each rank's memory, by part: parameters (frozen, "
                        "trainable), gradients, optimizer state, activations saved for backward, the rest, the "
                        "allocator's cache", "rank", "part")
        for row in state.ledger:
            for part, value in part_bytes(row).items():
                ledger.add_metric([str(row["rank"]), part], value)
        stalled = _gauge("stalled", "1 while the rank has ended no step for longer than its steps allow (the HANG "
                         "finding), else 0", "rank")
        hang = getattr(getattr(self.collector, "hang_watch", None), "hang", None)
        stalled_ranks = set(hang.stalled_ranks) if hang is not None else set()
        for rank in hellos:
            stalled.add_metric([str(rank)], 1.0 if rank in stalled_ranks else 0.0)
        yield from (step_time, phase_share, comm_wait, memory, steps_per_s, samples_per_s, tokens_per_s, mfu,
                    steps_total, findings, goodput_share, goodput_seconds, ledger, stalled)
        yield from self._system()

    def _system(self) -> Iterator[Metric]:
        """The node's latest sample: CPU and RAM, and each GPU as NVML reads it."""
        sample = self.collector.latest_system
        if sample is None:
            return
        cpu = _gauge("cpu_percent", "CPU in use: the whole machine (100 = every core) and the training "
                     "processes (100 = one core)", "scope")
        cpu.add_metric(["machine"], sample.cpu_percent)
        cpu.add_metric(["training"], sample.training_cpu_percent)
        ram = _gauge("ram_bytes", "Host RAM: used and total on the machine, resident in the training processes",
                     "kind")
        for kind, value in (("used", sample.ram_used_bytes), ("total", sample.ram_total_bytes),
                            ("training_rss", sample.training_rss_bytes)):
            ram.add_metric([kind], value)
        gpu_util = _gauge("gpu_utilization_percent", "GPU utilisation as NVML reports it (100 = the device busy "
                          "all the time)", "gpu")
        gpu_memory = _gauge("gpu_memory_bytes", "GPU memory, used and total, as NVML reports it (every process "
                            "on the device)", "gpu", "kind")
        gpu_temperature = _gauge("gpu_temperature_celsius", "GPU temperature", "gpu")
        gpu_power = _gauge("gpu_power_watts", "GPU power draw", "gpu")
        for gpu in sample.gpus:
            label = str(gpu.index)
            gpu_util.add_metric([label], gpu.utilization_percent)
            gpu_memory.add_metric([label, "used"], gpu.memory_used_bytes)
            gpu_memory.add_metric([label, "total"], gpu.memory_total_bytes)
            if gpu.temperature_c is not None:
                gpu_temperature.add_metric([label], gpu.temperature_c)
            if gpu.power_w is not None:
                gpu_power.add_metric([label], gpu.power_w)
        yield from (cpu, ram, gpu_util, gpu_memory, gpu_temperature, gpu_power)


def _gauge(name: str, help_text: str, *labels: str) -> GaugeMetricFamily:
    """A gauge traceml_<name>, labelled as given."""
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(f"traceml_{name}", help_text, labels=list(labels))


def _mfu(report: Optional[LayerReport], hello: Optional[RankHello], steps_per_s: float) -> Optional[float]:
    """The deep-dive's FLOPs a step at a rank's pace, against its device's known peak."""
    if report is None or not report.flops_per_step or hello is None or hello.device == "cpu":
        return None
    peak = device_peak_tflops(hello.device_name)
    return report.flops_per_step * steps_per_s / (peak * 1e12) if peak else None


def registry_for(collector: Collector, live_state: Callable[[], LiveState]) -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveMetrics(collector, live_state))
    return registry


class Scrape(TypedDict):
    content: bytes
    media_type: str


def exposition(registry: CollectorRegistry) -> Scrape:
    """The body and content type of one scrape."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return {"content": generate_latest(registry), "media_type": CONTENT_TYPE_LATEST}
