"""The field corpus: training scripts in the shapes real loops take (tests/field/), each run plain
and under TraceML. TraceML must be invisible in them: the same exit code, the same output (times
aside), byte-identical files, and one step per update. (Hugging Face Trainer's and Lightning's
runs are held against plain twins in test_integrations, beside the figures read there.)"""
import importlib.util
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, Run, _env

FIELD = Path(__file__).parent / "field"
CARD_TOP = "╭─ TraceML"
SAVED_LINE = re.compile(r"^traceml: run saved to .*\n", re.MULTILINE)
# What a script prints that is a time, and so differs from one run to the next.
TIMES = (re.compile(r"\d+(\.\d+)?(\s?(ms|s|it/s|s/it)\b)"), re.compile(r"ms/batch\s+[\d.]+"),
         re.compile(r"'((train|eval)_(runtime|samples_per_second|steps_per_second))': '?[\d.]+'?"),
         re.compile(r"\[\d\d:\d\d<\d\d:\d\d"),
         re.compile(r'"\w+_s": [\d.]+'),  # seconds a script measured, in the JSON line it prints
         re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]"))  # a logger's stamp (DeepSpeed's, imported by transformers)


def masked(text):
    for pattern in TIMES:
        text = pattern.sub("<time>", text)
    return text


def start(command, cwd):
    cwd.mkdir(parents=True, exist_ok=True)
    # Hash randomisation off: some libraries pickle a str hash (Hugging Face's GenerationConfig).
    env = dict(_env(), PYTHONHASHSEED="0")
    # SIGINT as a terminal gives it: a suite started as a background job runs with SIGINT ignored,
    # which a child inherits, and Python then installs no default_int_handler (process_habits.py
    # prints the handler it finds).
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def finish(process, timeout=240):
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def side_by_side(tmp_path, plain_command, traced_command):
    """Run both at once (the machine has two cores): plain in tmp/plain, traced in tmp/traced."""
    plain = start(plain_command, tmp_path / "plain")
    traced = start(traced_command, tmp_path / "traced")
    return finish(plain), Run(finish(traced), tmp_path / "traced" / "run")


def traceml_run(script, *args, traceml_args=()):
    return [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", "run",
            *traceml_args, str(script), *args]


def assert_invisible(plain, traced, plain_dir, traced_dir):
    """Same exit code and output; the traced run's card and one line after the script's own."""
    assert traced.returncode == plain.returncode == 0, traced.stderr[-3000:]
    script_stdout, card_top, card = traced.stdout.partition(CARD_TOP)
    assert card_top, traced.stdout[-2000:]  # the card came, after the script's own output
    assert masked(script_stdout) == masked(plain.stdout)
    assert len(SAVED_LINE.findall(traced.stderr)) == 1
    assert masked(SAVED_LINE.sub("", traced.stderr)) == masked(plain.stderr)
    plain_files = sorted(p.relative_to(plain_dir) for p in plain_dir.rglob("*") if p.is_file())
    traced_files = sorted(p.relative_to(traced_dir) for p in traced_dir.rglob("*") if p.is_file())
    assert plain_files and traced_files == plain_files
    for name in plain_files:
        assert (traced_dir / name).read_bytes() == (plain_dir / name).read_bytes(), name


def updates_printed(stdout):
    return int(re.search(r"^updates (\d+)$", stdout, re.MULTILINE).group(1))


@pytest.mark.parametrize("script, args, found_by", [
    pytest.param("gpt_memmap.py", [], "optimizer.step() (inferred)", id="gpt-memmap-accumulate-gradscaler-eval"),
    pytest.param("lstm_bptt.py", [], "backward() (inferred)", id="lstm-bptt-manual-sgd-save-model"),
    pytest.param("lstm_bptt.py", ["--use-optimizer", "--tied"], "optimizer.step() (inferred)",
                 id="lstm-bptt-sgd-tied"),
    pytest.param("gan.py", [], "optimizer.step() (inferred)", id="gan-two-optimizers"),
    pytest.param("compiled_ema.py", ["--backend", "aot_eager"], "optimizer.step() (inferred)",
                 id="compiled-ema-scheduler-tied"),
    pytest.param("moved_model.py", ["--how", "late-to"], "optimizer.step() (inferred)", id="late-model-to"),
    pytest.param("moved_model.py", ["--how", "own-forward"], "optimizer.step() (inferred)",
                 id="replaced-forward"),
    pytest.param("lbfgs_fit.py", [], "optimizer.step() (inferred)", id="lbfgs-closure"),
    pytest.param("autoencoder.py", [], "optimizer.step() (inferred)", id="encoder-decoder-one-optimizer"),
    pytest.param("process_habits.py", [], "optimizer.step() (inferred)",
                 id="own-logging-unclosed-file-atexit-late-thread"),
    pytest.param("sampled_lm.py", ["--steps", "30", "--compile-ema", "eager"], "optimizer.step() (inferred)",
                 id="generate-through-inner-net-compiled-ema-copy"),
    pytest.param("char_transformer.py", ["--steps", "120", "--epochs", "2"], "optimizer.step() (inferred)",
                 id="char-transformer-loader-workers-two-epochs"),
])
def test_a_field_script_runs_as_it_would_without_traceml(tmp_path, script, args, found_by):
    plain, traced = side_by_side(tmp_path, [sys.executable, str(FIELD / script), "--out", "out", *args],
                                 traceml_run(FIELD / script, "--out", "out", *args))
    assert_invisible(plain, traced, tmp_path / "plain" / "out", tmp_path / "traced" / "out")
    steps = traced.summary()["steps"]
    assert steps["count"] == updates_printed(plain.stdout)
    assert steps["found_by"] == found_by
    assert f"found by {found_by}" in traced.stdout
    if script == "autoencoder.py":  # both modules holding the optimizer's parameters are forward
        assert {row["forward_calls"] for row in traced.step_rows()[1:]} == {2}
    if script == "process_habits.py":  # what the process came with and how it ended: as plain
        assert "sockets held at start: 0\nSIGINT handler: default_int_handler\n" in traced.stdout
        assert "LOG INFO habits: main done" in traced.stdout
        assert traced.stdout.index("a thread finishing") < traced.stdout.index("atexit: goodbye")
        journal = (tmp_path / "traced" / "out" / "journal.txt").read_text().splitlines()
        assert len(journal) == steps["count"] == 20
    if script == "lbfgs_fit.py":  # the closure's forwards and backwards, every one, and the update
        rows = traced.step_rows()
        assert all(row["forward_calls"] >= 2 and row["optimizer_ms"] > 0 for row in rows[1:])


@pytest.fixture(scope="module")
def every_style_plain(tmp_path_factory):
    """every_style.py run once plain, for each traced way to compare with."""
    where = tmp_path_factory.mktemp("every_style") / "plain"
    return finish(start([sys.executable, str(FIELD / "every_style.py"), "--out", "out"], where)), where


@pytest.mark.xdist_group("every_style")  # one worker: the plain run is made once
@pytest.mark.parametrize("how, launcher", [
    ("trace_step", "python"), ("deep", "python"), ("trace_api", "python"),
    ("plain", "traceml run"), ("plain", "traceml run --deep")])
def test_every_way_of_tracing_leaves_the_model_as_it_was(tmp_path, every_style_plain, how, launcher):
    plain, plain_dir = every_style_plain
    script_args = [str(FIELD / "every_style.py"), "--out", "out", "--how", how]
    if launcher == "python":
        command = [sys.executable, *script_args]
    else:
        command = traceml_run(*script_args, traceml_args=["--deep"] if "--deep" in launcher else [])
    traced = Run(finish(start(command, tmp_path)), tmp_path / "run")
    if launcher == "python":  # plain python: the card at exit, the run under ./traceml_runs
        (traced.run_dir,) = (tmp_path / "traceml_runs").iterdir()
    assert_invisible(plain, traced.process, plain_dir / "out", tmp_path / "out")
    assert "'__main__.Classifier'" in plain.stdout and "traceml" not in plain.stdout
    assert traced.summary()["steps"]["count"] == updates_printed(plain.stdout)


def field_module(name):
    spec = importlib.util.spec_from_file_location(f"field_{name}", FIELD / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchs_flop_counter_changes_the_lora_llamas_gradients():
    """What makes llama_lora.py the test below's case: under FlopCounterMode (which deep-dive
    once ran a step in) silu's backward is decomposed, and the gradients' low bits move."""
    import torch
    from torch.nn import functional as F
    from torch.utils.flop_counter import FlopCounterMode

    llama = field_module("llama_lora")

    def gradients(counting):
        torch.manual_seed(0)
        model = llama.TinyLlama()
        llama.add_adapters(model)
        inputs, targets = next(llama.token_batches(1, 8, torch.Generator().manual_seed(1)))
        with FlopCounterMode(display=False) if counting else torch.enable_grad():
            F.cross_entropy(model(inputs).reshape(-1, llama.VOCAB), targets.reshape(-1)).backward()
        return [p.grad for p in model.parameters() if p.requires_grad]

    plain, counted = gradients(False), gradients(True)
    assert not all(torch.equal(a, b) for a, b in zip(plain, counted))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain, counted))


def lora_llama_flops(tokens):
    """llama_lora.py's Linears' products a step, by hand: 2·in·out·tokens forward, as much again
    for each gradient backward computes (the input's, the weight's). The first layer's inputs
    come from the frozen embedding and need none; the frozen weights need none."""
    llama = field_module("llama_lora")
    width, hidden, rank = llama.WIDTH, 4 * llama.WIDTH, 8

    def linear(fan_in, fan_out, products):
        return 2 * fan_in * fan_out * tokens * products

    attention_first = 3 * linear(width, width, 1) + linear(width, width, 2)  # q, k, v; o
    attention_after = 4 * linear(width, width, 2)
    adapters_first = 2 * (linear(width, rank, 2) + linear(rank, width, 3))  # q's and v's A and B
    adapters_after = 2 * (linear(width, rank, 3) + linear(rank, width, 3))
    mlp = 2 * linear(width, hidden, 2) + linear(hidden, width, 2)
    head = linear(width, llama.VOCAB, 2)
    return attention_first + adapters_first + attention_after + adapters_after + llama.BLOCKS * mlp + head


LORA = [str(FIELD / "llama_lora.py"), "--out", "out"]


@pytest.fixture(scope="module")
def lora_plain(tmp_path_factory):
    """llama_lora.py run once plain, for each traced way to compare with."""
    where = tmp_path_factory.mktemp("lora") / "plain"
    return finish(start([sys.executable, *LORA], where)), where


@pytest.mark.xdist_group("lora")  # one worker: the plain run is made once
@pytest.mark.parametrize("traceml_args, sampled_steps", [
    pytest.param([], [20, 21], id="auto-capture-sample"),  # the sample a capture compares with
    pytest.param(["--deep"], [10, 20], id="deep-dive"),
])
def test_a_lora_fine_tune_saves_the_same_adapter_with_layers_sampled(tmp_path, lora_plain, traceml_args,
                                                                     sampled_steps):
    """Sampled steps (deep-dive's, or the ones anomaly capture samples) run the model under
    module hooks and saved-tensor hooks only: the adapter saved is the plain run's, byte for byte."""
    plain, plain_dir = lora_plain
    traced = Run(finish(start(traceml_run(*LORA, traceml_args=traceml_args), tmp_path / "traced")),
                 tmp_path / "traced" / "run")
    assert_invisible(plain, traced, plain_dir / "out", tmp_path / "traced" / "out")
    assert [row["step"] for row in traced.step_rows() if row["instrumented"]] == sampled_steps
    if traceml_args:  # the FLOPs from the sampled steps' shapes: the matrix products, exactly
        assert traced.summary()["throughput"]["flops_per_step"] == lora_llama_flops(tokens=8 * 32)


def test_a_first_evaluation_ten_times_slower_is_named_apart_and_keeps_the_period(tmp_path):
    # The validation set is decoded on first use: the first evaluation (after update 10) reads
    # the whole file, every later one (each 10 updates) reads memory.
    plain, traced = side_by_side(tmp_path, [sys.executable, str(FIELD / "cached_validation.py"), "--out", "out"],
                                 traceml_run(FIELD / "cached_validation.py", "--out", "out"))
    assert_invisible(plain, traced, tmp_path / "plain" / "out", tmp_path / "traced" / "out")
    summary = traced.summary()
    assert summary["primary_diagnosis"]["kind"] == "COMPUTE_BOUND", summary["findings"]
    (found,) = [f for f in summary["findings"] if f["kind"] == "EVAL_HEAVY"]
    evidence = found["evidence"]
    # Eleven evaluations in the steps, every 10 steps, and the twelfth after the last step.
    assert evidence["period_steps"] == 10 and evidence["count"] == 12, found
    assert evidence["after_last_step_count"] == 1
    ((first, first_ms),) = [(o["step"], o["ms"]) for o in evidence["outliers"]]
    assert first < 15 and first_ms >= 5 * evidence["each_ms"]
    assert found["summary"].startswith(f"evaluated 12 times (every 10 steps, the last after the last step): "
                                       f"11 of about {evidence['each_ms']:.0f} ms, one of {first_ms:.0f} ms "
                                       f"at step {first}")
    # The numbers add up to the share of the run goodput gives evaluation.
    wall_ms = sum(part["seconds"] for part in summary["goodput"].values()) * 1e3
    said_ms = (evidence["count"] - 1) * evidence["each_ms"] + first_ms + evidence["elsewhere_ms"]
    assert said_ms / wall_ms == pytest.approx(summary["goodput"]["evaluation"]["share"], abs=1e-3)
    assert "STEP_SPIKES" not in {f["kind"] for f in summary["findings"]}


def test_a_loop_whose_steps_cannot_be_found_says_so_in_one_line(tmp_path):
    plain, traced = side_by_side(tmp_path, [sys.executable, str(FIELD / "grad_only.py"), "--out", "out"],
                                 traceml_run(FIELD / "grad_only.py", "--out", "out"))
    assert_invisible(plain, traced, tmp_path / "plain" / "out", tmp_path / "traced" / "out")
    summary = traced.summary()
    assert summary["steps"]["count"] == 0  # not the whole run presented as one step
    primary = summary["primary_diagnosis"]
    assert primary["kind"] == "INSUFFICIENT_DATA"
    assert primary["summary"].startswith("no training steps found")
    assert "`with traceml.trace_step(model):`" in primary["action"]
    card = (traced.run_dir / "final_summary.txt").read_text()
    assert re.search(r"Steps +none found", card)
    assert "Run longer" not in card and "phase" not in card  # no empty breakdown


def test_a_zero_code_script_that_raises_prints_its_own_traceback(tmp_path):
    args = ["--out", "out", "--fail-at", "7"]
    plain, traced = side_by_side(tmp_path, [sys.executable, str(FIELD / "gan.py"), *args],
                                 traceml_run(FIELD / "gan.py", *args))
    assert plain.returncode == traced.returncode == 1
    assert "RuntimeError: the discriminator diverged at iteration 7" in plain.stderr
    assert SAVED_LINE.sub("", traced.stderr) == plain.stderr  # no frame of TraceML's, no runpy
    assert traced.stdout.startswith(plain.stdout)
    assert traced.summary()["steps"]["count"] == 7  # the steps before the failing one
