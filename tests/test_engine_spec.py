"""Engine spec files: a server described by a command template and its knobs, searched through the
serve stage. This project's engine server on the tiny dense checkpoint, described by a spec file
as if it were foreign, searched end to end on the CPU under real AIPerf load: a configuration that
exits at start is a crash and the next one runs, one behind a relay that answers wrong under load
fails the accuracy gate, and every configuration is a child run with its knobs, its command line
and its verdict. The shipped files (vLLM, SGLang, this engine) load and render; a file with a
placeholder naming no knob, a knob no placeholder uses or a default outside its range is refused
when loaded, one line naming it (exit 2 from the command). TPE's proposals over a small space."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from tiny_checkpoints import checkpoint

from cli.main import main
from targets.engine_spec import SpecError, load_spec, shipped
from tracking.trials import PENDING, EngineTrial

FAKES = Path(__file__).resolve().parent / "serve_fakes"
SERVING = {"traffic": [{"name": "chat-short", "concurrency": 2, "input_tokens_mean": 24,
                        "output_tokens_mean": 8, "request_count": 6, "warmup_requests": 1}],
           "accuracy": {"held_out": 2, "held_out_tokens": 12, "max_tokens": 6}, "max_model_len": 512}
ENGINE = ("{python} -m engine_templates.engine serve --model-dir {model_dir} --port {port} "
          "--served-model-name {served_model_name} --dtype fp32 --max-model-len {max_model_len} "
          "--max-num-seqs {max_num_seqs}")
# The engine, or a relay in front of it that is right alone and wrong in company
# (tests/serve_fakes/batching_bug_server.py); the engine's max_num_seqs only where it is the server.
# max_num_seqs 0 the engine refuses at start. The defaults (the engine, 4) are the baseline; the
# space besides them: the relay, the engine with 0, the engine with 8.
AS_FOREIGN = {
    "engine": "foreign",
    "command": "{server}",
    "start_timeout_s": 300,
    "knobs": {
        "server": {"type": "choice", "choices": ["engine", "relay"], "default": "engine",
                   "arg": {"engine": ENGINE,
                           "relay": f"{sys.executable} {FAKES / 'batching_bug_server.py'} {{port}} {{model_dir}} "
                                    "{served_model_name}"}},
        "max_num_seqs": {"type": "int", "low": 0, "high": 8, "step": 4, "default": 4, "when": {"server": "engine"}},
    },
}


def spec_file(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def test_the_shipped_files_load_and_render_their_flags():
    assert shipped() == ["infersmith", "sglang", "vllm"]
    vllm = load_spec("vllm")
    on = vllm.defaults() | {"ngram_speculation": True, "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    filled = vllm.render(on).format(port=8000, model_dir="/m", name="served", replica=0, python="py",
                                    max_model_len=2048)
    argv = shlex.split(filled)
    assert argv[:6] == ["env", "VLLM_NO_USAGE_STATS=1", "vllm", "serve", "/m", "--port"]
    assert argv[argv.index("--max-model-len") + 1] == "2048" and "--enable-prefix-caching" in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    # off, its settings do not apply: neither in the configuration nor on the command line
    assert "num_speculative_tokens" not in vllm.defaults() and "--speculative-config" not in vllm.render(vllm.defaults())
    sglang = load_spec("sglang").render(load_spec("sglang").defaults())
    assert sglang.startswith("{python} -m sglang.launch_server --model-path {model_dir} --port {port}")
    ours = load_spec("infersmith")
    assert "--max-num-seqs 64 --max-num-batched-tokens 2048 --block-size 16" in ours.render(ours.defaults())


@pytest.mark.parametrize("change, says", [
    ({"command": "{server} --flag {nope}"}, "command: placeholder {nope} names no knob; knobs: server, max_num_seqs"),
    ({"knobs": {**AS_FOREIGN["knobs"], "max_num_seqs": {"type": "int", "low": 0, "high": 8, "step": 4,
                                                         "default": 12}}},
     "knob max_num_seqs: default 12 is outside its range (0 to 8 by 4)"),
    ({"knobs": {**AS_FOREIGN["knobs"], "unused": {"type": "bool", "default": False}}},
     "knob unused has no placeholder: put {unused} in the command or another knob's arg"),
    ({"knobs": {**AS_FOREIGN["knobs"], "max_num_seqs": {"type": "int", "low": 0, "high": 8, "default": 4,
                                                         "when": {"server": "other"}}}},
     "knob max_num_seqs: when server is 'other', outside server's range ('engine', 'relay')"),
    ({"knobs": {"server": {"type": "int", "low": 1, "high": 2, "default": 1, "colour": "red"}}},
     "knobs.server.colour: Extra inputs are not permitted"),
])
def test_a_bad_spec_file_is_refused_when_loaded_in_one_line(tmp_path, capsys, change, says):
    path = spec_file(tmp_path, AS_FOREIGN | change)
    with pytest.raises(SpecError) as e:
        load_spec(str(path))
    assert str(e.value) == f"engine spec {path}: {says}"
    model_dir = str(checkpoint("dense"))
    capsys.readouterr()  # making the checkpoint prints progress
    code = main(["optimize-engine", "--engine-spec", str(path), "--model-dir", model_dir, "--model", "tiny"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"infersmith: engine spec {path}: {says}"


def test_tpe_proposes_every_configuration_once_and_never_the_baseline(tmp_path):
    from proposers.engine_spec import SpecProposer

    spec = load_spec(str(spec_file(tmp_path, AS_FOREIGN)))
    search = SpecProposer(spec, "tpe", seed=3)
    history: list[EngineTrial] = []
    while fresh := search.propose(history, 1):
        cand = fresh[0]
        history.append(EngineTrial(cand, cand.id, "crash" if len(history) % 2 else PENDING))
    # the relay's configuration has no max_num_seqs: the knob does not apply there
    assert sorted(json.dumps(t.candidate.settings, sort_keys=True) for t in history) == [
        '{"max_num_seqs": 0, "server": "engine"}', '{"max_num_seqs": 8, "server": "engine"}', '{"server": "relay"}']
    # the server command each renders, its own stage placeholders left for the host
    relay = next(t.candidate for t in history if t.candidate.settings == {"server": "relay"})
    assert relay.command == f"{sys.executable} {FAKES / 'batching_bug_server.py'} {{port}} {{model_dir}} {{name}}"
    assert relay.label == "foreign[server=relay]"


def test_the_optimize_engine_deployment_takes_the_spec_files_name():
    from prefect.utilities.callables import parameter_schema

    from flows.deployments import DeploySettings, declarations
    from flows.optimize_engine import optimize_engine
    from flows.sweep import SweepPlan

    settings = DeploySettings(plan=SweepPlan(ops=["rmsnorm"], targets=[{"model": "tiny"}]), work_pool="infersmith",
                              cron="0 2 * * *", timezone="UTC", active=True)
    deployment = {d.name: d for d in declarations(settings)}["optimize-engine"]
    assert "engine_spec" in deployment._parameter_openapi_schema.properties
    assert "engine_spec" in parameter_schema(optimize_engine).properties


def test_a_search_of_a_foreign_server_crash_wrong_answers_and_all(prefect_server, tmp_path, monkeypatch):
    from flows.optimize_engine import optimize_engine
    from targets import Target
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))  # a store of its own: nothing tried yet
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    target = Target.model_validate({"model": "tiny", "dtype": "fp32", "budget": {"candidates": 4},
                                    "serving": SERVING})
    result = optimize_engine(str(checkpoint("dense")), target, seed=1, engine_spec=str(spec_file(tmp_path, AS_FOREIGN)))
    assert result["candidates"] == 3  # the space besides the baseline, then nothing new

    client = Tracker(TrackingConfig.from_env()).client
    parent = client.get_run(result["parent_run_id"])
    assert parent.data.params["engine_spec"].endswith("spec.yaml")
    # the baseline: the file's defaults, the engine with max_num_seqs 4, under the same load
    assert parent.data.metrics["baseline/chat-short/output_tps"] > 0
    runs = {r.info.run_name: r for r in client.search_runs([parent.info.experiment_id],
                                                           f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert set(runs) == {"foreign[server=engine,max_num_seqs=0]", "foreign[server=relay]",
                         "foreign[server=engine,max_num_seqs=8]"}

    exits = runs["foreign[server=engine,max_num_seqs=0]"]
    assert exits.data.tags["infersmith.status"] == "crash" and exits.data.tags["infersmith.failing_gate"] == "server_start"
    assert "--max-num-seqs must be at least 1" in exits.data.tags["infersmith.failing_detail"]
    assert exits.data.params["knob.max_num_seqs"] == "0" and exits.data.params["engine"] == "foreign"

    wrong = runs["foreign[server=relay]"]
    assert wrong.data.tags["infersmith.status"] == "fail" and wrong.data.tags["infersmith.failing_gate"] == "accuracy"
    assert wrong.data.tags["infersmith.failing_detail"].startswith("under load on pattern chat-short: prompt")
    assert "knob.max_num_seqs" not in wrong.data.params

    good = runs["foreign[server=engine,max_num_seqs=8]"]
    assert good.data.tags["infersmith.status"] in ("pass", "fail")  # CPU timings: either way
    assert good.data.tags["infersmith.failing_gate"] in ("", "all_metrics")
    assert good.data.metrics["chat-short/ttft_p50_ms"] > 0 and good.data.metrics["chat-short/baseline_output_tps"] > 0
    verdict = json.loads(Path(client.download_artifacts(good.info.run_id, "verdict.json")).read_text())
    assert [g["name"] for g in verdict["gates"]] == ["accuracy", "accuracy", "all_metrics"]
    # the command line as rendered, and as the server ran it with its port
    rendered = Path(client.download_artifacts(good.info.run_id, "command.txt")).read_text()
    assert rendered.startswith("{python} -m engine_templates.engine serve --model-dir {model_dir} --port {port}")
    ran = shlex.split(Path(client.download_artifacts(good.info.run_id, "serve/server.command")).read_text())
    assert ran[ran.index("--max-num-seqs") + 1] == "8" and ran[ran.index("--max-model-len") + 1] == "512"
    assert ran[ran.index("--port") + 1].isdigit()
