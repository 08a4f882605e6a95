"""The entropy lens (docs/lens.md) in a real browser: headless Chromium, driven by selenium,
against a real `entropic serve` process with an API key. One server and one browser for the
module; answers are a few tokens long.

The page's own network calls are observed (and, for two tests, replaced) by wrapping
`window.fetch` from the test: the page calls the global fetch, so a wrapper sees every
request body and can cut a stream short or feed the page a stream of hostile tokens.
Set LENS_SCREENSHOTS=docs to refresh the screenshots in docs/ from the last test.
"""
from __future__ import annotations

import json
import math
import os
import re
import time

import httpx
import pytest

from entropic.server.launch import page_url
from lens_browser import (by, entropy_colour, fill, open_page, rgb, send, start_chromium,
                          text_of, wait_for)
from serving import ServerProcess

KEY = "lens-key-42"
PROMPT = "Name three colours."


# ---- without a browser or a model -----------------------------------------------------------
def test_page_url():
    assert page_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/"
    assert page_url("0.0.0.0", 80) == "http://127.0.0.1:80/"
    assert page_url("::", 9) == "http://[::1]:9/"
    assert page_url("::1", 9) == "http://[::1]:9/"


def test_no_ui_flag():
    import argparse

    from entropic.server.launch import add_serve_args
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).ui is True
    assert p.parse_args(["--no-ui"]).ui is False


def test_assets_ship_in_the_package_and_name_no_remote_source():
    from entropic.server.lens import load_assets
    assets = load_assets()
    assert {"/", "/lens/index.html", "/lens/app.js", "/lens/vendor/uPlot.iife.min.js"} <= set(assets)
    page = assets["/"][0].decode()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    for path, (body, kind) in assets.items():
        if kind.startswith("text/javascript") and "vendor" not in path:
            # nothing that parses a string as markup or code
            bad = r"\.(inner|outer)HTML\s*[+]?=|insertAdjacentHTML|document\.write|\beval\(|new Function"
            assert not re.search(bad, body.decode()), path


# ---- a real server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    # the model's load is not what is tested here, and on a busy machine it takes minutes;
    # --pruning so that the server view shows blocks attended / live
    with ServerProcess("--threads", "1", "--dtype", "float32", "--api-key", KEY, "--pruning",
                       "--max-num-seqs", "4", "--kv-cache-gib", "0.1", "--log-level", "warning",
                       timeout=600) as s:
        yield s


@pytest.mark.model
def test_static_route_headers_and_guards(server):
    base = server.base
    r = httpx.get(base + "/")
    assert r.status_code == 200 and "entropy lens" in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(base + "/lens/vendor/uPlot.iife.min.js").status_code == 200
    assert httpx.get(base + "/lens/nope.js").status_code == 404
    assert httpx.get(base + "/lens/../app.py").status_code == 404
    # the API behind it still wants the key, and the Host check covers the page too
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(base + "/", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(base + "/v1/models", headers={"Host": "evil.example",
                                                  "Authorization": f"Bearer {KEY}"}
                     ).status_code == 400
    assert f"open {server.base}/ in a browser" in server.log_text()
    # the server view's source: /metrics, with the pruning counts behind attended / live
    metrics = httpx.get(base + "/metrics").text
    assert "entropic_decode_blocks_live " in metrics
    assert "entropic_decode_blocks_attended " in metrics
    assert "entropic_prefill_pairs_attended " in metrics


# ---- the browser ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = start_chromium(tmp_path_factory.mktemp("downloads"))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def greedy(driver, server):
    """One greedy answer in the page, its token spans, the body the page sent, and the same
    body answered by the API directly (not streamed)."""
    d = driver
    open_page(d, server.base, KEY)
    d.execute_script("""
        window.__batches = 0;
        new MutationObserver(() => window.__batches++).observe(
          document.getElementById('pg-transcript'), {childList: true, subtree: true});""")
    answer = send(d, PROMPT, max_tokens=10, temperature=0)
    spans = [{"text": s.get_attribute("textContent"), "entropy": float(s.get_attribute("data-entropy")),
              "colour": rgb(s.value_of_css_property("background-color"))}
             for s in answer.find_elements("css selector", ".tok")]
    sent = d.execute_script("return window.__sent")
    assert len(sent) == 1 and sent[0]["url"] == "/v1/chat/completions"
    body = dict(sent[0]["body"], stream=False)
    body.pop("stream_options")
    direct = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"}).json()
    return {"spans": spans, "body": sent[0]["body"], "direct": direct["choices"][0],
            "batches": d.execute_script("return window.__batches")}


@pytest.mark.model
def test_streamed_answer_colours_match_the_api(greedy):
    body, direct, spans = greedy["body"], greedy["direct"], greedy["spans"]
    assert body["stream"] is True and body["entropic"]["entropy"] is True
    assert body["messages"] == [{"role": "user", "content": PROMPT}]
    # streamed: the tokens reached the page in several batches, not at once at the end
    assert greedy["batches"] >= 3
    api_h = direct["entropic"]["entropies"]
    assert len(spans) == len(api_h) == 10
    assert "".join(s["text"] for s in spans) == direct["message"]["content"]
    for s, h in zip(spans, api_h):
        assert s["entropy"] == pytest.approx(h, abs=1e-4)
        want = entropy_colour(h)
        assert all(abs(a - b) <= 1 for a, b in zip(s["colour"], want)), (s, h, want)
    # the colours are not all one: the answer has both sure and unsure tokens
    assert len({s["colour"] for s in spans}) > 2


@pytest.mark.model
def test_hover_card_shows_the_top_alternatives(driver, greedy):
    from selenium.webdriver import ActionChains
    d = driver
    direct = greedy["direct"]["logprobs"]["content"]
    spans = by(d, "#pg-transcript .turn.assistant .tok")
    # the token whose distribution is most spread, so its alternatives matter
    k = max(range(len(spans)), key=lambda i: greedy["spans"][i]["entropy"])
    ActionChains(d).move_to_element(spans[k]).perform()
    card = wait_for(lambda: [c for c in by(d, "#hovercard") if c.is_displayed()], 5, "the card")[0]
    rows = card.find_elements("css selector", ".alts li")
    want = direct[k]["top_logprobs"]
    assert len(rows) == len(want) == 5
    vis = lambda s: s.replace(" ", "·").replace("\n", "↵").replace("\t", "⇥") or "∅"
    for row, alt in zip(rows, want):
        tok = row.find_element("css selector", "code").get_attribute("textContent")
        p = row.find_element("css selector", ".alt-p").text
        assert tok == vis(alt["token"])
        # two significant digits below 10 %
        assert float(p.rstrip("%")) == pytest.approx(100 * math.exp(alt["logprob"]), rel=0.05)
    assert card.find_element("css selector", ".card-h").text == \
        f"{greedy['spans'][k]['entropy']:.3f} nats"
    assert card.find_element("css selector", ".card-t").text == "0 (greedy)"
    assert card.find_element("css selector", ".card-ht").text == "0.000 nats"  # a point mass
    assert "chosen" in rows[0].get_attribute("class")  # greedy: the top one was taken
    # a tap (click) pins it; Escape closes it
    spans[k].click()
    ActionChains(d).move_by_offset(0, 300).perform()
    assert card.is_displayed()
    ActionChains(d).send_keys("\ue00c").perform()
    wait_for(lambda: not card.is_displayed(), 5, "the card to close")


@pytest.mark.model
def test_thermostat_toggle_changes_the_request_body(driver, server):
    d = driver
    open_page(d, server.base, KEY)
    send(d, PROMPT, max_tokens=3, temperature=0.8)
    by(d, "#pg-thermostat")[0].click()
    fill(d, "pg-target_entropy", 3)
    send(d, "And three animals.", max_tokens=6)
    first, second = [s["body"] for s in d.execute_script("return window.__sent")]
    assert "thermostat" not in first["entropic"]
    assert second["entropic"]["thermostat"] == {"target_entropy": 3, "eta": 0.2, "t_min": 0.2,
                                                "t_max": 2, "mode": "stabilize"}
    assert second["temperature"] == 0.8 and second["seed"] == first["seed"] == 1
    # a chat: the second request carries the first turn and its answer
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert not by(d, "#pg-message")[0].is_displayed()
    # under the thermostat the temperature moved away from T_0 = 0.8 (the card says so)
    from selenium.webdriver import ActionChains
    last = by(d, "#pg-transcript .turn.assistant .tok")[-1]
    ActionChains(d).move_to_element(last).perform()
    t = float(wait_for(lambda: by(d, "#hovercard .card-t")[0].text, 5, "the card"))
    assert 0.2 <= t <= 2.0 and t != 0.8
    # and the trace shows the tempered entropy it steered
    assert "H^T_t nats" in [e.text for e in by(d, "#pg-trace .u-series th")]


@pytest.mark.model
def test_tempered_entropy_trace_is_the_apis_with_no_gaps(driver, server):
    """The H^T_t trace is the API's entropic.tempered_entropies, every token, also where
    T_t sits at T_max (where a recovery from the temperatures would have no value): the
    value the thermostat's law stepped on, and the same as a direct, non-streamed request
    with the same body returns."""
    from entropic.control.thermostat import next_temperature
    d = driver
    open_page(d, server.base, KEY)
    by(d, "#pg-thermostat")[0].click()
    fill(d, "pg-target_entropy", 6)  # out of reach: T climbs to T_max and stays there
    fill(d, "pg-eta", 0.5)
    fill(d, "pg-t_max", 1.3)
    send(d, PROMPT, max_tokens=12, temperature=0.8)
    (sent,) = d.execute_script("return window.__sent")
    cols = d.execute_script("return document.getElementById('pg-trace').traceChart.data()")
    labels = [e.text for e in by(d, "#pg-trace .u-series th")]
    assert labels[1:3] == ["H_t nats", "H^T_t nats"]
    hs, hts, ts = cols[1], cols[2], cols[3]
    assert len(hts) == 12 and None not in hts
    assert sum(abs(t - 1.3) < 1e-6 for t in ts) >= 3  # clamped at T_max: no gap there
    body = dict(sent["body"], stream=False)
    body.pop("stream_options")
    direct = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"}).json()["choices"][0]
    assert direct["entropic"]["tempered_entropies"] == pytest.approx(hts, abs=1e-6)
    assert direct["entropic"]["entropies"] == pytest.approx(hs, abs=1e-6)
    th = sent["body"]["entropic"]["thermostat"]
    for i in range(11):
        want = next_temperature(ts[i], max(hts[i], 0.0), th["target_entropy"], th["eta"],
                                th["t_min"], th["t_max"], "stabilize")
        assert ts[i + 1] == pytest.approx(want, rel=1e-5)


@pytest.mark.model
def test_completion_mode(driver, server):
    d = driver
    open_page(d, server.base, KEY)
    by(d, 'input[name="pg-mode"][value="completion"]')[0].click()
    fill(d, "pg-stop", "\\n")  # typed as backslash-n
    answer = send(d, "The capital of France is", max_tokens=4, temperature=0)
    (sent,) = d.execute_script("return window.__sent")
    assert sent["url"] == "/v1/completions" and sent["body"]["prompt"] == "The capital of France is"
    assert sent["body"]["logprobs"] == 5 and sent["body"]["stop"] == ["\n"]
    toks = answer.find_elements("css selector", ".tok")
    assert 1 <= len(toks) <= 4 and all(t.get_attribute("data-entropy") for t in toks)
    assert text_of(d, "#pg-transcript .turn.prompt .answer") == "The capital of France is"


@pytest.mark.model
def test_api_key_is_required(driver, server):
    d = driver
    open_page(d, server.base, None)
    assert wait_for(lambda: "API key needed" in by(d, "#server-status")[0].text, 10, "status")
    fill(d, "pg-prompt", PROMPT)
    by(d, "#pg-send")[0].click()
    msg = wait_for(lambda: [m for m in by(d, "#pg-message") if m.is_displayed()], 10, "message")[0]
    assert "API key" in msg.text
    assert not by(d, "#pg-transcript .tok")
    assert by(d, "#pg-prompt")[0].get_attribute("value") == PROMPT  # kept to send again
    fill(d, "api-key", "wrong")
    by(d, "#key-form button")[0].click()
    by(d, "#pg-send")[0].click()
    wait_for(lambda: "refused this API key" in by(d, "#pg-message")[0].text, 10, "refusal")
    fill(d, "api-key", KEY)
    by(d, "#key-form button")[0].click()
    send(d, PROMPT, max_tokens=3)
    assert len(by(d, "#pg-transcript .tok")) == 3
    assert not by(d, "#pg-message")[0].is_displayed()


HOSTILE = '<img src=x onerror="window.__pwned=1">'


@pytest.mark.model
def test_markup_in_prompts_and_model_output_is_shown_as_text(driver, server):
    d = driver
    open_page(d, server.base, KEY)
    prompt = "<script>window.__pwned=2</script><b>bold?</b>"
    send(d, prompt, max_tokens=3)
    user = by(d, "#pg-transcript .turn.user .answer")[-1]
    assert user.get_attribute("textContent") == prompt
    # model output: the page is fed a stream whose tokens are markup
    chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": HOSTILE},
                          "logprobs": {"content": [{"token": HOSTILE, "logprob": -0.1,
                                                    "top_logprobs": [
                                                        {"token": HOSTILE, "logprob": -0.1},
                                                        {"token": "<script>x</script>",
                                                         "logprob": -2.5}]}]},
                          "entropic": {"entropies": [1.5], "temperatures": [0.7]},
                          "finish_reason": None}]}
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                        "entropic": {"entropies": [], "temperatures": [], "tau": 0.0,
                                     "mean_entropy": 1.5, "tau_per_tflop": 0.0}}]}
    sse = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(end)}\n\ndata: [DONE]\n\n"
    d.execute_script("""
        const sse = arguments[0];
        window.fetch = async (url, opts = {}) => opts.method === 'POST'
          ? new Response(sse, {headers: {'Content-Type': 'text/event-stream'}})
          : window.__realFetch(url, opts);""", sse)
    answer = send(d, "anything", max_tokens=3)
    assert answer.get_attribute("textContent") == HOSTILE
    from selenium.webdriver import ActionChains
    ActionChains(d).move_to_element(answer.find_elements("css selector", ".tok")[0]).perform()
    card = by(d, "#hovercard")[0]
    assert "<script>x</script>" in card.text
    assert not by(d, "#pg-transcript img, #pg-transcript script, #pg-transcript b, #hovercard img")
    assert d.execute_script("return window.__pwned === undefined")


@pytest.mark.model
def test_a_dropped_stream_is_reported_and_the_page_goes_on(driver, server):
    d = driver
    open_page(d, server.base, KEY)
    # pass the real answer through, but break the connection after its second event
    d.execute_script("""
        window.__recording = window.fetch;
        window.fetch = async (url, opts = {}) => {
          const resp = await window.__recording(url, opts);
          if (opts.method !== 'POST') return resp;
          const events = (await resp.text()).split('\\n\\n').filter(Boolean);
          const enc = new TextEncoder();
          let i = 0;
          const body = new ReadableStream({pull(c) {
            if (i < 2) c.enqueue(enc.encode(events[i++] + '\\n\\n'));
            else c.error(new TypeError('network error'));
          }});
          return new Response(body, {headers: {'Content-Type': 'text/event-stream'}});
        };""")
    answer = send(d, PROMPT, max_tokens=8)
    msg = by(d, "#pg-message")[0]
    assert msg.is_displayed() and "cut off after 2 tokens" in msg.text
    assert len(answer.find_elements("css selector", ".tok")) == 2
    assert "broken" in answer.get_attribute("class")
    assert by(d, "#pg-prompt")[0].get_attribute("value") == PROMPT
    d.execute_script("window.fetch = window.__recording")
    answer = send(d, PROMPT, max_tokens=4)
    assert len(answer.find_elements("css selector", ".tok")) == 4
    assert not msg.is_displayed()
    # the retry sent the question once, not the broken turn
    first, retry = [s["body"] for s in d.execute_script("return window.__sent")]
    assert first["messages"] == retry["messages"] == [{"role": "user", "content": PROMPT}]


@pytest.mark.model
def test_an_error_inside_a_stream_is_reported(driver, server):
    d = driver
    open_page(d, server.base, KEY)
    one = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                        "logprobs": {"content": [{"token": "Hi", "logprob": -0.2,
                                                  "top_logprobs": []}]},
                        "entropic": {"entropies": [0.4], "temperatures": [0.7]},
                        "finish_reason": None}]}
    err = {"error": {"message": "the engine failed this request", "type": "server_error",
                     "param": None, "code": None}}
    sse = f"data: {json.dumps(one)}\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n"
    d.execute_script("""
        const sse = arguments[0];
        window.fetch = async (url, opts = {}) => opts.method === 'POST'
          ? new Response(sse, {headers: {'Content-Type': 'text/event-stream'}})
          : window.__realFetch(url, opts);""", sse)
    answer = send(d, PROMPT, max_tokens=3)
    assert answer.get_attribute("textContent") == "Hi"
    assert text_of(d, "#pg-message") == ("The request failed after 1 token: the server "
                                         "reported: the engine failed this request.")
    assert by(d, "#pg-send")[0].is_enabled()


@pytest.mark.model
def test_exports(driver, server):
    d = driver
    open_page(d, server.base, KEY)
    send(d, PROMPT, max_tokens=5)
    for old in d.downloads.iterdir():
        old.unlink()
    by(d, "#pg-json")[0].click()
    by(d, "#pg-png")[0].click()
    js = d.downloads / "entropic-trace.json"
    png = d.downloads / "entropic-trace.png"
    wait_for(lambda: js.exists() and png.exists() and png.stat().st_size > 1000, 10, "downloads")
    rec = json.loads(js.read_text())
    assert len(rec["tokens"]) == 5 and rec["request"]["max_tokens"] == 5
    assert all(t["tempered_entropy"] is not None for t in rec["tokens"])
    assert rec["entropic"]["tau"] == pytest.approx(rec["tokens"][-1]["cumulative_tau"], abs=1e-4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.model
def test_compare_runs_both_and_overlays_their_traces(driver, server):
    d = driver
    open_page(d, server.base, KEY, view="compare")
    fill(d, "cmp-max_tokens", 6)
    by(d, "#cmp-run")[0].click()
    wait_for(lambda: by(d, "#cmp-run")[0].is_enabled() and
             len(by(d, "#cmp-a-out .tok")) == 6 and len(by(d, "#cmp-b-out .tok")) == 6,
             60, "both answers")
    a, b = [s["body"] for s in d.execute_script("return window.__sent")]
    assert a["messages"] == b["messages"] and a["seed"] == b["seed"]
    assert "thermostat" not in a["entropic"] and "thermostat" in b["entropic"]
    # one chart, three traces per run
    labels = [e.text for e in by(d, "#cmp-trace .u-series th")]
    # H_t, H^T_t, T_t, cumulative tau for each
    assert sum("(A)" in x for x in labels) == sum("(B)" in x for x in labels) == 4
    cols = d.execute_script("return document.getElementById('cmp-trace').traceChart.data()")
    assert len(cols) == 9 and all(None not in c for c in cols)
    assert cols[2] == pytest.approx(cols[1], abs=1e-6)  # A at T = 1: H^T = H
    assert "tokens 6" in by(d, "#cmp-a-stats")[0].text


@pytest.mark.model
def test_server_view(driver, server):
    d = driver
    open_page(d, server.base, KEY, view="server")
    wait_for(lambda: text_of(d, "#srv-tps .value") not in (None, "–"), 10, "two polls of /metrics")
    assert text_of(d, "#srv-running .value") == "0"
    assert text_of(d, "#srv-kv .label").startswith("KV blocks in use of ")
    assert float(text_of(d, "#srv-entropy .value")) > 0  # tokens were sampled before
    # pruning is on: the share of live blocks attended since start, and its chart
    assert re.fullmatch(r"blocks attended / live \(since start \d+\.\d%\)",
                        text_of(d, "#srv-pruning .label"))
    # "idle" when no decode step ran between the last two polls
    assert re.fullmatch(r"idle|\d+\.\d%", text_of(d, "#srv-pruning .value"))
    assert by(d, "#srv-charts .chart.small")[-1].is_displayed()
    # no CSP violation and no script error all session long (the 401s the key test
    # provoked are logged as network errors, and are meant)
    logs = [e for e in d.get_log("browser") if e["level"] == "SEVERE"
            and e.get("source") != "network"]
    assert not logs, logs


@pytest.mark.model
def test_screenshots_of_each_view(driver, server, tmp_path):
    """One screenshot per view, as a newcomer would see it; LENS_SCREENSHOTS=docs writes
    them to docs/ (docs/lens.md shows them), otherwise to a temporary folder."""
    from selenium.webdriver import ActionChains
    d = driver
    out = os.environ.get("LENS_SCREENSHOTS")
    target = (os.path.join(os.path.dirname(__file__), "..", out) if out else str(tmp_path))
    busy = bool(out)  # longer answers and some load for the real pictures
    open_page(d, server.base, KEY)
    by(d, "#pg-thermostat")[0].click()
    send(d, "Write a short poem about the sea.", max_tokens=48 if busy else 16, temperature=0.7)
    spans = by(d, "#pg-transcript .turn.assistant .tok")
    k = max(range(len(spans)), key=lambda i: float(spans[i].get_attribute("data-entropy")))
    ActionChains(d).move_to_element(spans[k]).perform()
    d.save_screenshot(os.path.join(target, "lens_playground.png"))
    open_page(d, server.base, KEY, view="compare")
    fill(d, "cmp-max_tokens", 48 if busy else 8)
    by(d, "#cmp-run")[0].click()
    wait_for(lambda: by(d, "#cmp-run")[0].is_enabled() and by(d, "#cmp-b-out .tok"), 120, "B")
    d.set_window_size(1280, 1180)  # the overlaid chart under both answers
    d.save_screenshot(os.path.join(target, "lens_compare.png"))
    d.set_window_size(1280, 900)
    d.get(f"{server.base}/#server")
    if busy:  # a few answers in flight while the page polls
        for _ in range(3):
            by(d, "#tab-compare")[0].click()
            by(d, "#cmp-run")[0].click()
            by(d, "#tab-server")[0].click()
            time.sleep(5)
    wait_for(lambda: text_of(d, "#srv-tps .value") not in (None, "–"), 10, "two polls")
    d.save_screenshot(os.path.join(target, "lens_server.png"))
    for name in ("lens_playground.png", "lens_compare.png", "lens_server.png"):
        with open(os.path.join(target, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
