"""`kinject serve` through real clients: the openai package and httpx against a live server this test
starts on 127.0.0.1 (a free port), on the built-in model. Greedy answers equal transformers' generate on
the same prompt; 32 concurrent clients all get complete answers; bad input is a 4xx JSON error and the
next request is served; a client that leaves cancels its request; a killed server comes back clean and
SIGTERM exits within seconds. The server runs its default engine, a process of its own; the engine
process never outlives the server, and a dead engine turns /health and requests into 503s; the
in-process engine answers as transformers too."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kinject.fixtures import tiny_moe_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAME = "kinject-builtin"
PROMPTS = ["def fibonacci(n):", "import torch\nimport torch.nn as nn\n\nclass", "# Hot experts are loaded first and"]
CHAT = [{"role": "system", "content": "python"}, {"role": "user", "content": "def load_config(path):"}]
START_TIMEOUT_S = 240


class Server:
    """``kinject serve`` in a subprocess; ``url`` once it printed its ready line."""

    def __init__(self, tmp: Path, port: int = 0, extra: tuple = ()):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.log = tmp / f"server-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "kinject", "serve", "--port", str(port), "--dtype", "float32",
                                      "--batch-wait-ms", "20", "--threads", "1", *extra],
                                     stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, env=env, cwd=tmp)
        deadline = time.monotonic() + START_TIMEOUT_S
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("kinject serve:") or not line and self.proc.poll() is not None:
                break
        assert line.startswith("kinject serve:"), f"server did not start: {line!r} {self.log.read_text()[-2000:]}"
        self.url = line.split(" on ")[1].split(" ")[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Untouched transformers: greedy ids of one prompt (no padding), cut at EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32, attn_implementation="eager").eval()

    def greedy(ids: list[int], new: int) -> tuple[str, int]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        out = out[:out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out
        return tok.decode(out, skip_special_tokens=True), len(out)

    greedy.tok = tok
    return greedy


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def engine_pid(server: Server) -> int:
    """The engine process of ``server`` (multiprocessing's spawned child, not its resource tracker)."""
    found = [c for c in children(server.proc.pid)
             if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, found
    return found[0]


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.rsplit(" ", 1)[0] == name or ln.startswith(name + "{"))


# ------------------------------------------------------------------ the openai package


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completion_plain_and_streamed_equal_generate(client, reference, prompt):
    ids = reference.tok(prompt)["input_ids"]
    want, n = reference(ids, 10)
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert got.choices[0].text == want and got.object == "text_completion"
    assert got.choices[0].finish_reason == ("stop" if n < 10 else "length")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), n)
    chunks = list(client.completions.create(model="default", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_chat_plain_and_streamed_use_the_template(client, reference):
    ids = reference.tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    want, n = reference(ids, 8)
    got = client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=8, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == n
    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_stop_max_tokens_n_and_seed(client, reference):
    prompt = PROMPTS[2]
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert len(full) >= 4, full
    stop = full[len(full) // 2:len(full) // 2 + 2]             # a stop string the greedy text really holds
    cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    short = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens <= 3 and full.startswith(short.choices[0].text)
    a = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.9, seed=11, n=2)
    b = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.9, seed=11, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and [c.index for c in a.choices] == [0, 1]


# ------------------------------------------------------------------ bad input


def test_bad_input_is_a_4xx_json_error_and_the_next_request_is_served(server, client):
    post = lambda path, **kw: httpx.post(server.url + path, timeout=60, **kw)  # noqa: E731
    r = post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert "malformed JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="'temperature' must be in"):
        client.completions.create(model=NAME, prompt="x", temperature=3.5)
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be >= 1"):
        client.completions.create(model=NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.completions.create(model=NAME, prompt="def f(x):\n" * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user"}])
    r = post("/v1/nope", json={})
    assert r.status_code == 404 and "is not served" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/completions", timeout=30).status_code == 405
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens >= 1
    assert metric(server.url, 'kinject_requests_total{endpoint="/v1/completions",status="400"}') >= 3


# ------------------------------------------------------------------ concurrency


def _one(url: str, i: int) -> dict:
    """Request ``i`` of the load test: completion or chat, streamed or not; what came back, checked."""
    chat, stream = i % 2 == 1, i % 3 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": NAME, "max_tokens": 6 + i % 5, "temperature": 0, "stream": stream}
    body.update({"messages": [{"role": "user", "content": PROMPTS[i % 3]}]} if chat else {"prompt": PROMPTS[i % 3]})
    if stream:
        body["stream_options"] = {"include_usage": True}
        text, reasons, usage, done = "", [], None, False
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    continue
                c = json.loads(data)
                assert "error" not in c, c["error"]             # e.g. 503 while the server shuts down
                for ch in c["choices"]:
                    text += ch["delta"].get("content") or "" if chat else ch["text"]
                    reasons += [ch["finish_reason"]] if ch["finish_reason"] else []
                usage = c.get("usage") or usage
        assert done and len(reasons) == 1
        return {"i": i, "text": text, "reason": reasons[0], "usage": usage}
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"i": i, "text": c["message"]["content"] if chat else c["text"], "reason": c["finish_reason"],
            "usage": r.json()["usage"]}


def test_32_concurrent_clients_all_answered(server):
    before = metric(server.url, "kinject_requests_total")
    groups_before = metric(server.url, "kinject_batch_groups_total")
    total = 64
    t0 = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: _one(server.url, i), range(total), timeout=600))
    assert time.monotonic() - t0 < 600
    assert sorted(r["i"] for r in results) == list(range(total))                  # none lost
    for r in results:
        assert r["reason"] in ("stop", "length")
        u = r["usage"]
        assert u["completion_tokens"] <= 6 + r["i"] % 5 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert r["reason"] == "stop" or u["completion_tokens"] == 6 + r["i"] % 5
    # the same request gets the same greedy answer whatever group it joined
    by_kind: dict = {}
    for r in results:
        by_kind.setdefault((r["i"] % 2, r["i"] % 3, 6 + r["i"] % 5), set()).add(r["text"])
    assert all(len(texts) == 1 for texts in by_kind.values())
    assert metric(server.url, "kinject_requests_total") - before == total
    groups = metric(server.url, "kinject_batch_groups_total") - groups_before
    assert groups < total                                                         # requests shared groups
    assert metric(server.url, "kinject_queue_depth") == 0
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("kinject_tokens_per_second", "kinject_bytes_moved_total{tier=\"host\"}", "kinject_tier_bytes"):
        assert name in text


def test_client_that_leaves_cancels_its_request(server):
    """The engine stops the sequence: far fewer than its 900 tokens (all 900 when nobody hangs up)."""
    before = metric(server.url, "kinject_requests_cancelled_total")
    tokens_before = metric(server.url, "kinject_generation_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0.7, "seed": 1,
                            "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())                                    # the first chunk, then hang up
    deadline = time.monotonic() + 60
    while metric(server.url, "kinject_requests_cancelled_total") <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server.url, "kinject_requests_cancelled_total") == before + 1
    deadline = time.monotonic() + 60                            # its sequence stopped: the worker is free again
    while metric(server.url, "kinject_sequences_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server.url, "kinject_sequences_running") == 0
    assert metric(server.url, "kinject_generation_tokens_total") - tokens_before < 600
    assert _one(server.url, 0)["reason"] in ("stop", "length")


def test_client_that_leaves_while_waiting_cancels_its_request(server):
    """A streamed request still waiting for a group (the running one is full: n = 8) whose client hangs
    up is taken out of the queue, never generated."""
    before = metric(server.url, "kinject_requests_cancelled_total")
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0.7, "seed": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={**body, "n": 8}) as full:
        lines = full.iter_lines()                               # kept: a dropped iterator hangs up
        next(lines)                                             # its group runs
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json=body) as waiting:
            assert waiting.status_code == 200
            deadline = time.monotonic() + 60
            while metric(server.url, "kinject_requests_waiting") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(server.url, "kinject_requests_waiting") == 1
        deadline = time.monotonic() + 60                        # hung up: out of the queue
        while metric(server.url, "kinject_requests_waiting") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(server.url, "kinject_requests_waiting") == 0
        assert metric(server.url, "kinject_requests_cancelled_total") == before + 1
        assert metric(server.url, "kinject_sequences_running") == 8
    deadline = time.monotonic() + 60
    while metric(server.url, "kinject_sequences_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server.url, "kinject_requests_cancelled_total") == before + 2


# ------------------------------------------------------------------ kill, restart, SIGTERM


def test_killed_server_comes_back_clean_and_sigterm_exits_in_seconds(tmp_path, reference):
    first = Server(tmp_path)
    url = first.url
    first_children = children(first.proc.pid)
    assert engine_pid(first) in first_children
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_one, url, i) for i in range(16)]
        time.sleep(0.5)
        first.stop(signal.SIGKILL)                              # mid-run: no clean-up at all
        for f in futures:
            try:
                f.result(timeout=120)
            except (httpx.HTTPError, AssertionError, ValueError):
                pass                                            # cut off: a broken connection, a torn last chunk
    assert gone_within(first_children, 30), first_children      # the engine saw the server die and exited
    second = Server(tmp_path, port=first.port)                  # the same port, free again
    second_children = children(second.proc.pid)
    try:
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ids = reference.tok(PROMPTS[0])["input_ids"]
        assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6,
                                         temperature=0).choices[0].text == reference(ids, 6)[0]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_one, second.url, i) for i in range(16)]
            time.sleep(1.0)
            t0 = time.monotonic()
            rc = second.stop(signal.SIGTERM, timeout=60)
            took = time.monotonic() - t0
            outcomes = []
            for f in futures:
                try:
                    outcomes.append(f.result(timeout=60)["reason"])
                except (httpx.HTTPError, AssertionError, ValueError) as exc:
                    outcomes.append(type(exc).__name__)         # refused (503) or cut after the grace period
        assert rc == 0 and took < 30, (rc, took, second.log.read_text()[-2000:])
        assert "Traceback" not in second.log.read_text(), second.log.read_text()[-3000:]
        assert len(outcomes) == 16
        assert gone_within(second_children, 10), second_children  # no orphan engine
    finally:
        second.stop(signal.SIGKILL)


def test_dead_engine_answers_503_and_never_hangs(tmp_path):
    """The engine process killed mid-stream: the stream ends with a 503 error, /health and new requests
    answer 503 at once, and SIGTERM still stops the server in seconds (exit 1: its engine failed)."""
    srv = Server(tmp_path)
    try:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0.7, "seed": 3, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json=body) as r:
            lines = r.iter_lines()
            next(lines)                                         # generating
            os.kill(engine_pid(srv), signal.SIGKILL)
            rest = [ln for ln in lines if ln]                   # ends (timeout=60 would raise if it hung)
        assert rest and '"code": 503' in rest[-1] and "engine process is not running" in rest[-1], rest[-3:]
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        r = httpx.post(srv.url + "/v1/completions", timeout=10, json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        t0 = time.monotonic()
        assert srv.stop(signal.SIGTERM, timeout=30) == 1 and time.monotonic() - t0 < 15
        assert "the engine process exited" in srv.log.read_text()
    finally:
        srv.stop(signal.SIGKILL)


def test_load_errors_are_the_cli_error_line(tmp_path):
    """A rule-file error is raised before any process starts; a checkpoint the engine process cannot
    load is the same one-line error, exit 2, as loading in the server's own process would give."""
    import shutil

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    serve = [sys.executable, "-m", "kinject", "serve", "--port", "0", "--threads", "1"]
    r = subprocess.run([*serve, "--set", "pipeline.nope=1"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "unknown pipeline key 'nope'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_moe_path(), bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for engine in ("process", "inprocess"):
        r = subprocess.run([*serve, "--model", str(bad), "--engine", engine], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("kinject: error: checkpoint file"), \
            (engine, r.stderr[-2000:])
        assert "model.safetensors is truncated" in r.stderr and "Traceback" not in r.stderr


def test_inprocess_engine_answers_as_generate(tmp_path, reference):
    """``--engine inprocess``: the worker thread in the server's own process, same answers."""
    srv = Server(tmp_path, extra=("--engine", "inprocess"))
    try:
        assert not [c for c in children(srv.proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ids = reference.tok(PROMPTS[1])["input_ids"]
        want, n = reference(ids, 9)
        assert client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=9, temperature=0).choices[0].text == want
        chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=9, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert srv.stop(signal.SIGTERM, timeout=30) == 0
    finally:
        srv.stop(signal.SIGKILL)


def test_engine_waits_for_shutdown_after_begin_shutdown():
    """``begin_shutdown`` ends the engine's worker (no group runs) but not the engine: it exits, code 0,
    when told ``shutdown``, so the server never takes a clean stop for a crash (a 1 exit code)."""
    from kinject.app.batcher import ServeMetrics
    from kinject.app.engine_process import EngineClient, EngineOptions

    engine = EngineClient.start_engine(EngineOptions(None, None, ("pipeline.n_batches=2",), dtype="float32", threads=1),
                                       ServeMetrics())
    try:
        assert (engine.plan.n, engine.plan.size) == (2, 2 * engine.plan.bs)
        engine.begin_shutdown()
        engine.process.join(1.5)
        assert engine.process.is_alive()
        t0 = time.monotonic()
        engine.shutdown(5.0)
        assert engine.process.exitcode == 0 and time.monotonic() - t0 < 10 and engine.failure is None
    finally:
        engine.close()
