"""DDP with gloo on the CPU, 2 ranks: every rank traced, stragglers named with their cause,
two nodes on one machine, a rank killed mid-run, and a user's own torchrun launch."""
import json
import socket
import subprocess
import sys

import pytest

from conftest import SCRIPTS, Run, _env
from traceml import rendezvous
from traceml.collector.server import Collector
from traceml.collector.store import Store
from traceml.records import encode_frame
from test_records import hello, step

DDP_LOOP = SCRIPTS / "ddp_loop.py"


def ddp_run(traceml_run, *script_args, **kwargs):
    run = traceml_run(*script_args, script=DDP_LOOP, traceml_args=("--nproc-per-node", "2"), **kwargs)
    return run


def stragglers(summary):
    return [f for f in summary["findings"] if f["kind"].endswith("STRAGGLER")]


def test_balanced_ranks_have_no_straggler(traceml_run):
    # 120 steps: two ranks share this machine's two cores with the collector, and over 30
    # steps the rank beside it came out behind in 75% of them about one run in five.
    run = ddp_run(traceml_run, "--steps", 120)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["run"]["world_size"] == 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    measured = 120 - summary["steps"]["warmup_excluded"]
    assert all(r["steps"] == measured and r["comm_wait_median_ms"] is not None for r in summary["ranks"])
    assert stragglers(summary) == []
    assert {row["rank"] for row in run.step_rows()} == {0, 1}
    assert "across ranks" in run.stdout and "worst rank" in run.stdout
    assert run.stdout.count("TraceML ·") == 1  # one card for the run, not one per rank
    # The comm hook that times collective wait lives in DDP's reducer, not on the wrapper.
    assert "rank 0 saved the DDP model, traceml in it: False" in run.stdout


def test_rank_with_a_slow_dataset_is_an_input_straggler(traceml_run):
    run = ddp_run(traceml_run, "--steps", 30, "--slow-rank", 1, "--load-ms", 2)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    primary = summary["primary_diagnosis"]
    assert (primary["kind"], primary["rank"]) == ("INPUT_STRAGGLER", 1)
    assert primary["severity"] == "crit"
    # Rank 1 waits 8 x 2 ms for its data; the other rank loses about that in its all-reduce.
    assert primary["evidence"]["rank_value_ms"] > 12.0
    assert primary["evidence"]["others_median_ms"] < 3.0
    assert primary["evidence"]["share"] > 0.4
    by_rank = {r["rank"]: r for r in summary["ranks"]}
    assert by_rank[0]["comm_wait_median_ms"] > by_rank[1]["comm_wait_median_ms"] + 10.0
    assert summary["rank_spread"]["input_wait"]["worst_rank"] == 1


def test_rank_with_extra_forward_compute_is_a_compute_straggler(traceml_run):
    run = ddp_run(traceml_run, "--steps", 30, "--slow-rank", 1, "--busy-ms", 10)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    (found,) = stragglers(summary)
    assert (found["kind"], found["rank"]) == ("COMPUTE_STRAGGLER", 1)
    assert found["evidence"]["rank_value_ms"] - found["evidence"]["others_median_ms"] > 8.0
    assert "forward and backward compute" in found["summary"]


def test_a_killed_rank_is_reported_missing_and_the_rest_is_kept(traceml_run):
    # Rank 1 (8 ms a step on its slow data) is killed at step 25; torchrun then stops rank 0.
    run = ddp_run(traceml_run, "--steps", 60, "--slow-rank", 1, "--load-ms", 1, "--die-at", 25)
    assert run.returncode != 0
    summary = run.summary()
    assert summary["run"]["exit_code"] == run.returncode
    (missing,) = summary["missing_ranks"]
    assert missing["rank"] == 1 and 10 <= missing["from_step"] <= 25
    assert {r["rank"] for r in summary["ranks"]} == {0, 1}  # rank 1's steps before it are kept
    rows = run.step_rows()
    assert max(r["step"] for r in rows if r["rank"] == 0) >= missing["from_step"]
    assert "rank 1 from step" in (run.run_dir / "final_summary.txt").read_text()


def test_two_nodes_on_one_machine_make_one_run(tmp_path):
    master_port = _free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(master_port)]
    run_dir = tmp_path / "run"
    node0 = subprocess.Popen([sys.executable, "-m", "traceml", "run", "--run-dir", str(run_dir), *common,
                              "--node-rank", "0", str(DDP_LOOP), "--steps", "20"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    node1 = subprocess.run([sys.executable, "-m", "traceml", "run", *common, "--node-rank", "1",
                            str(DDP_LOOP), "--steps", "20"],
                           capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    out0, err0 = node0.communicate(timeout=120)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + node1.stderr
    assert "node 1 done" in node1.stderr and "TraceML ·" not in node1.stdout
    assert not (tmp_path / "traceml_runs").exists()  # node 1 keeps no run of its own
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["run"]["world_size"] == 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(r["last_step"] == 19 for r in summary["ranks"])


def test_a_users_own_torchrun_launch_is_traced_with_one_card(tmp_path):
    process = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", str(_free_port()), str(DDP_LOOP), "--steps", "20"],
                             capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.count("TraceML ·") == 1
    (run_dir,) = (tmp_path / "traceml_runs").iterdir()
    run = Run(process, run_dir)
    summary = run.summary()
    assert summary["run"]["world_size"] == 2 and summary["steps"]["count"] == 20
    assert {row["rank"] for row in run.step_rows()} == {0, 1}


def test_a_routable_collector_needs_a_token():
    with pytest.raises(rendezvous.RendezvousError, match="TRACEML_TOKEN"):
        rendezvous.bind_host("10.1.2.3", env={})
    assert rendezvous.bind_host("10.1.2.3", env={"TRACEML_TOKEN": "s3cret"}) == "10.1.2.3"
    assert rendezvous.bind_host("localhost", env={}) == "127.0.0.1"


def test_a_collector_with_a_token_drops_ranks_without_it(tmp_path):
    collector = Collector(Store(str(tmp_path / "t.sqlite")), token="s3cret")
    collector.start()
    try:
        stranger = socket.create_connection(("127.0.0.1", collector.port))
        stranger.sendall(encode_frame([hello(), step(0)]))  # no token in its hello
        stranger.settimeout(5)
        assert stranger.recv(1) == b""
        member = socket.create_connection(("127.0.0.1", collector.port))
        greeting = hello()
        greeting.token = "s3cret"
        member.sendall(encode_frame([greeting, step(1)]))
        member.close()
        assert collector.wait_for_ranks(timeout_s=5)
    finally:
        collector.stop()
    assert [s.step for s in collector.store.steps()] == [1]
    assert collector.store.hellos()[0].token == ""  # the secret is never stored


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
