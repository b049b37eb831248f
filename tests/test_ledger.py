"""The memory ledger is exact on the CPU: each part held against sums computed by hand from the
model, the optimizer and the batch; and it finds PEFT's adapters as PEFT counts them, under the
Trace API, `traceml run` and Hugging Face Trainer.

The in-process tests read a LedgerWatch (and, for activations, a LayerProbe) on real models and
real autograd; only the sender they hand their figures to is replaced by a list.
"""
import json
import re

import pytest
import torch
from torch import nn

from conftest import SCRIPTS
from traceml.analysis.ledger import ledger_rows, part_bytes
from traceml.probe.layers import LayerProbe
from traceml.probe.ledger import LedgerWatch
from traceml.records import StepRecord, adapter_target

FP32 = 4


def bytes_of(parameters):
    return sum(p.numel() * p.element_size() for p in parameters)


def read(models=(), optimizers=()):
    ledger = LedgerWatch(rank=0, clock=lambda: 0.0)
    for model in models:
        ledger.watch_model(model)
    for optimizer in optimizers:
        ledger.watch_optimizer(optimizer)
    return ledger.reading(step=1)


def one_step(model, optimizer, batch):
    optimizer.zero_grad()
    model(batch).sum().backward()
    optimizer.step()


def half_frozen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    return model


@pytest.mark.parametrize("name, target", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "q_proj"),
    ("base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector.default.weight", "down_proj"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head"),
    ("base_model.model.lm_head.original_module.weight", None),  # the frozen copy modules_to_save keeps
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", None),
])
def test_adapter_parameters_are_told_by_name_with_their_target(name, target):
    assert adapter_target(name) == target


def test_tied_weights_and_views_count_once():
    torch.manual_seed(0)
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied, as language models tie input and output embeddings
    norm = nn.LayerNorm(4)
    norm.requires_grad_(False)
    model = nn.ModuleDict({"embed": embed, "head": head, "norm": norm})
    ledger = read([model])
    assert ledger.trainable_bytes == 10 * 4 * FP32
    assert ledger.frozen_bytes == 2 * 4 * FP32
    assert ledger.parameters == 10 * 4 + 2 * 4
    assert ledger.trainable_dtypes == {"float32": 10 * 4 * FP32}


def test_adam_keeps_two_fp32_states_per_trainable_parameter_and_a_frozen_half_no_gradients():
    model = half_frozen()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable)
    one_step(model, optimizer, torch.randn(4, 16))
    ledger = read([model], [optimizer])
    assert ledger.trainable_bytes == bytes_of(trainable) == (32 * 8 + 8) * FP32
    assert ledger.frozen_bytes == bytes_of(model[0].parameters()) == (16 * 32 + 32) * FP32
    assert ledger.gradient_bytes == bytes_of(trainable)  # the frozen half has none
    # exp_avg and exp_avg_sq, each the parameter's size, and the step count, one fp32 scalar each.
    assert ledger.optimizer_state_bytes == {"Adam": 2 * bytes_of(trainable) + FP32 * len(trainable)}


def test_sgd_with_momentum_keeps_one_state_and_two_optimizers_are_told_apart():
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(8, 8), nn.Linear(8, 2)
    model = nn.Sequential(encoder, decoder)
    first = torch.optim.SGD(encoder.parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.SGD(decoder.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    first.step()
    second.step()
    ledger = read([model], [first, second])
    assert ledger.optimizer_state_bytes == {"SGD": bytes_of(encoder.parameters()),
                                            "SGD 2": bytes_of(decoder.parameters())}
    assert ledger.gradient_bytes == bytes_of(model.parameters())


def test_reading_an_optimizer_adds_nothing_to_its_state():
    model = half_frozen()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    read([model], [optimizer])  # before its first step: its state is empty, and must stay so
    assert len(optimizer.state) == 0


def test_dtypes_are_told_and_an_unmoved_reading_is_not_sent_again():
    model = half_frozen()
    model[0].to(torch.bfloat16)
    ledger = LedgerWatch(rank=0)
    ledger.watch_model(model)
    first = ledger.reading(step=1)
    assert first.frozen_dtypes == {"bfloat16": (16 * 32 + 32) * 2}
    assert ledger.reading(step=2) is None  # nothing moved
    model[2].weight.requires_grad_(False)  # requires_grad flips: the split moves
    assert ledger.reading(step=3).frozen_bytes == first.frozen_bytes + 32 * 8 * FP32


class _Sender:
    def __init__(self):
        self.ledger = LedgerWatch(rank=0)
        self.sent = []

    def push(self, record):
        self.sent.append(record)


class _ProbeOnCpu:
    timeline = None
    device_memory = None
    rank = 0

    def __init__(self):
        self.sender = _Sender()


def sampled_activations(model, batch, micro_batches=1):
    """The activations a sampled step of this model records, and the step's gradients."""
    probe = _ProbeOnCpu()
    probe.sender.ledger.watch_model(model)
    layers = LayerProbe(probe, model, every_n_steps=1, auto_capture=False)
    layers.begin_step(1)
    for _ in range(micro_batches):
        with layers.saved_tensors_context():
            output = model(batch)
        output.sum().backward()
        layers.backward_done()
    layers.end_step()
    return probe.sender.ledger


def test_a_linears_activation_is_its_input():
    torch.manual_seed(0)
    ledger = sampled_activations(nn.Linear(8, 16), torch.randn(32, 8))
    assert ledger.activation_bytes == 32 * 8 * FP32  # the weight is saved too, but it is a parameter


def test_a_small_mlps_activations_are_its_input_and_its_hidden_layer_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ledger = sampled_activations(model, torch.randn(32, 8))
    # ReLU saves its output, which the second Linear saves as its input: one storage.
    assert ledger.activation_bytes == 32 * (8 + 16) * FP32


def test_accumulated_micro_batches_peak_at_one_micro_batchs_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ledger = sampled_activations(model, torch.randn(32, 8), micro_batches=3)
    assert ledger.activation_bytes == 32 * (8 + 16) * FP32  # each backward frees its micro-batch's


def test_a_sampled_steps_end_sends_its_reading_with_every_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    probe = _ProbeOnCpu()
    probe.sender.ledger.watch_model(model)
    layers = LayerProbe(probe, model, every_n_steps=1, auto_capture=False)
    layers.begin_step(1)
    with layers.saved_tensors_context():
        output = model(torch.randn(32, 8))
    output.sum().backward()
    layers.backward_done()
    model.zero_grad(set_to_none=True)  # gone before the step ends: the sampled backward saw them
    layers.end_step()
    (reading,) = probe.sender.sent
    assert reading.gradient_bytes == bytes_of(model.parameters())
    assert reading.activation_bytes == 32 * (8 + 16) * FP32 and reading.activation_step == 1


def test_readings_at_step_starts_are_paced_to_one_every_two_seconds():
    model = half_frozen()
    ledger = LedgerWatch(rank=0)
    ledger.watch_model(model)
    first, next_step = ledger.at_step_start(1, now_s=100.0)
    assert first is not None and next_step == 2
    assert ledger.at_step_start(2, now_s=100.01) == (None, 2 + 200)  # 10 ms a step: 200 steps is 2 s
    model[2].weight.requires_grad_(False)
    moved, next_step = ledger.at_step_start(202, now_s=102.01)
    assert moved.frozen_bytes > first.frozen_bytes and 200 <= next_step - 202 <= 201


def test_the_rest_is_what_the_host_holds_beyond_the_parts():
    model = half_frozen()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    one_step(model, optimizer, torch.randn(4, 16))
    ledger = read([model], [optimizer])
    steps = [StepRecord(rank=0, step=s, start_unix_s=0.0, step_ms=1.0, input_wait_ms=0, outside_ms=0, h2d_ms=0,
                        forward_ms=0, backward_ms=0, optimizer_ms=0, untraced_ms=0, gc_ms=0, gc_collections=0,
                        forward_calls=1, samples=4, host_rss_bytes=rss)
             for s, rss in ((1, 300 * 2 ** 20), (2, 310 * 2 ** 20))]
    (row,) = ledger_rows([ledger], steps)
    parts = part_bytes(row)
    assert row["measured_on"] == "host_rss" and row["held"] == 310 * 2 ** 20
    assert sum(parts.values()) == row["held"]  # the parts and the rest add up to what was held
    assert parts["optimizer_state"] == parts["parameters_trainable"] == parts["gradients"]


def run_peft(traceml_run, plain_run, how):
    """The Trace API under plain python; the plain loop (zero-code, under deep-dive) and Trainer
    under `traceml run`."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    if how == "trace-api":
        run = plain_run("--how", how, script=SCRIPTS / "peft_lora.py", timeout=240)
    else:
        traceml_args = ("--deep",) if how == "plain" else ()
        run = traceml_run("--how", how, script=SCRIPTS / "peft_lora.py", traceml_args=traceml_args, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    counted = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("PEFT "))[5:])
    return run, counted


@pytest.mark.parametrize("how", ["trace-api", "plain", "trainer"])
def test_a_peft_lora_fine_tunes_adapters_are_peft_s_trainable_parameters(traceml_run, plain_run, how):
    run, counted = run_peft(traceml_run, plain_run, how)
    summary = run.summary()
    (row,) = summary["memory"]["ledger"]
    adapters = row["adapters"]
    assert adapters["kind"] == "LoRA" and adapters["r"] == 8
    assert adapters["count"] == counted["trainable"]
    assert adapters["parameters"] == row["parameters"]["trainable"] == counted["trainable"] * FP32
    assert row["parameters"]["frozen"] == (counted["total"] - counted["trainable"]) * FP32
    assert set(adapters["targets"]) == {"q_proj", "v_proj"}
    assert adapters["targets"]["q_proj"] == adapters["targets"]["v_proj"] == adapters["parameters"] // 2
    assert adapters["gradients"] == adapters["parameters"]
    # AdamW: two states the size of each adapter weight, and a step count (lora_A and lora_B in
    # each of 2 layers' q_proj and v_proj: 8 tensors).
    assert adapters["optimizer_state"] == row["optimizer_state"] == 2 * adapters["parameters"] + 8 * FP32
    assert row["activations"] and row["rest"] is not None
    card = run.run_dir.joinpath("final_summary.txt").read_text()
    assert "LoRA r=8 on q_proj, v_proj: 16.0 KiB trainable (4.0% of parameters)" in " ".join(card.split())
    if how == "plain":  # the deep-dive's figures of the same run (one run: each costs seconds of imports)
        under_deep_dive_the_adapters_time_is_told_and_layer_names_wrap_whole(adapters, card)


# -- the memory rules name the part -----------------------------------------------------------
MIB = 2 ** 20


def ledger_row(**parts):
    """A ledger row as analysis.ledger makes it, on a device whose peak held `held` bytes."""
    row = {"rank": 0, "parameters": {"trainable": parts.get("trainable", 0), "frozen": parts.get("frozen", 0)},
           "gradients": parts.get("gradients", 0), "optimizer_state": parts.get("optimizer_state", 0),
           "activations": parts.get("activations", 0), "cache": parts.get("cache", 0),
           "measured_on": "device_peak", "growth": parts.get("growth", {})}
    counted = sum(v for k, v in parts.items() if k not in ("growth", "cache", "held"))
    row["held"] = parts.get("held", counted)
    row["rest"] = row["held"] - counted
    return row


@pytest.mark.parametrize("largest, words, advice", [
    ("optimizer_state", "optimizer state", "8-bit optimizer"),
    ("activations", "activations", "activation checkpointing"),
    ("frozen", "frozen parameters", "quantized"),
    ("cache", "the allocator's cache", "expandable_segments:True"),
])
def test_memory_pressure_names_the_part_that_holds_most_and_what_to_do_about_it(largest, words, advice):
    from test_diagnose import window
    from traceml.diagnose.memory import MemoryLimits, memory_pressure

    parts = {"trainable": 100 * MIB, "gradients": 100 * MIB, "optimizer_state": 200 * MIB,
             "activations": 150 * MIB, "frozen": 50 * MIB, "cache": 0}
    parts[largest] = 500 * MIB
    row = ledger_row(**parts, held=sum(v for k, v in parts.items() if k != "cache") + 10 * MIB)
    found = memory_pressure(window(), MemoryLimits(device_capacity_bytes=1100 * MIB),
                            peak_device_bytes=1050 * MIB, peak_rss_bytes=None, ledger=[row])
    assert found.evidence["largest_part"] == {"frozen": "parameters_frozen"}.get(largest, largest)
    assert f"the largest part is {words}: 500.0 MiB" in found.summary
    assert advice in found.action


def test_memory_creep_names_the_part_that_grows_or_the_rest():
    from test_diagnose import memory_window
    from traceml.diagnose.memory import MemoryLimits, memory_creep

    held = memory_window([1024 * MIB + i * 2 * MIB for i in range(50)])
    limits = MemoryLimits(device_capacity_bytes=2048 * MIB)
    grows = memory_creep(held, limits, ledger=[ledger_row(optimizer_state=200 * MIB,
                                                          growth={"optimizer_state": 98 * MIB, "activations": 0})])
    assert grows.evidence["growing_part"] == "optimizer_state"
    assert "optimizer state grows" in grows.summary and "optimizer state growing)" in grows.summary
    assert "8-bit optimizer" in grows.action
    flat = memory_creep(held, limits, ledger=[ledger_row(optimizer_state=200 * MIB, growth={"optimizer_state": 0})])
    assert flat.evidence["growing_part"] == "rest"
    assert "stay flat" in flat.summary and "loss.item()" in flat.action


def under_deep_dive_the_adapters_time_is_told_and_layer_names_wrap_whole(adapters, card):
    assert 0 < adapters["forward_share"] < 1 and 0 < adapters["backward_share"] < 1
    assert "adapters take" in " ".join(card.split())
    # The prefix every layer shares is written once, above the tables; each name is cut only
    # after a dot or a space, never inside a word.
    assert "│ under base_model.model." in card
    # The tables end at the coverage note, which a run shows only where its layers cover little
    # of the model's time (a busy machine moves that), else at the verdict.
    table = re.split(r"Coverage|Verdict", card[card.index("top by time"):])[0]
    assert "base_model." not in table
    cells, in_rows = [], False
    for line in table.splitlines():
        cell = line.strip("│ ").split("  ")[0]
        if cell.startswith("───"):
            in_rows = True
        elif not cell:
            in_rows = False
        elif in_rows:
            cells.append(cell)
    assert len(cells) >= 10, table
    for cell, after in zip(cells, cells[1:] + [""]):  # cut after a dot, or before the type
        if not (cell.endswith((".", ")")) or after.startswith("(")):
            pytest.fail(f"a layer's name wraps inside a word: {cell!r}\n{table}")
