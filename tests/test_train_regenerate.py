"""Regeneration through an OpenAI-compatible server (training/regenerate.py), against a real loopback HTTP
server (tests/openai_server.py): protocol, retries, errors naming the prompt, crash-safe resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_zoo.training.data import Record, prompt_ids, regenerate
from dflash_zoo.training.regen_state import RegenerationError, load_partial, read_examples
from dflash_zoo.training.regenerate import Endpoint, Generation, Regenerator
from tests.openai_server import OpenAIServer, answer
from tests.tiny import tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOK = tiny_tokenizer()
EOS = TOK.eos_token_id


def _records(n: int = 12) -> list[Record]:
    return [Record(i + 1, prompt=f"prompt number {i} " + "ab" * (i % 4)) for i in range(n)]


def _key(rec: Record, gen: Generation = Generation()) -> str:
    return ",".join(map(str, prompt_ids(rec, TOK, gen.raw, gen.chat_kwargs, gen.prompt_tokens)))


def _expected(rec: Record, finish: str = "stop") -> tuple[int, ...]:
    ids = prompt_ids(rec, TOK)
    resp = TOK.encode(answer(_key(rec)), add_special_tokens=False)
    return tuple(ids + resp + ([EOS] if finish == "stop" else []))


def _run(server, tmp_path, records, **ep) -> list:
    endpoint = Endpoint(
        server.url, **({"concurrency": 4, "retries": 3, "timeout": 5.0, "backoff": 0.01} | ep)
    )
    return Regenerator(records, TOK, endpoint, Generation(), tmp_path / "key.jsonl").run()


def test_completions_protocol_and_result_file(tmp_path):
    recs = _records()
    with OpenAIServer() as server:
        server.finish[_key(recs[3])] = "length"  # ran out of tokens: no stop token appended
        exs = _run(server, tmp_path, recs)
    assert [e.ids for e in exs] == [_expected(r, "length" if i == 3 else "stop") for i, r in enumerate(recs)]
    assert all(e.start == len(prompt_ids(r, TOK)) for e, r in zip(exs, recs, strict=True))
    body = server.bodies[0]
    assert body["model"] == "tiny" and body["temperature"] == 0.0 and body["top_p"] == 1.0
    assert "seed" not in body and isinstance(body["prompt"], list)  # greedy: token ids, no seed
    assert ("/v1/completions", _key(recs[0])) in server.log
    # the built-in path's cache format: its reader gives the same examples; the partial state is gone
    assert regenerate(recs, None, TOK, cache_file=tmp_path / "key.jsonl") == exs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.jsonl"]


def test_chat_api_sends_messages_with_template_switches(tmp_path):
    recs = [Record(1, prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]),
            Record(2, text="plain text line for completion")]  # fmt: skip
    gen = Generation(chat_kwargs={"enable_thinking": False}, temperature=0.7, seed=5)
    with OpenAIServer() as server:
        ep = Endpoint(server.url + "/v1", api="chat", backoff=0.01)
        exs = Regenerator(recs, TOK, ep, gen, tmp_path / "k.jsonl").run()
    chat = next(b for p, b in zip(server.log, server.bodies, strict=True) if p[0] == "/v1/chat/completions")
    assert chat["messages"] == recs[0].prompt and chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["seed"] == 5 and chat["temperature"] == 0.7  # sampling: a per-prompt seed, no server defaults
    assert (chat["top_p"], chat["top_k"], chat["min_p"], chat["repetition_penalty"]) == (1.0, -1, 0.0, 1.0)
    text = next(b for p, b in zip(server.log, server.bodies, strict=True) if p[0] == "/v1/completions")
    assert text["seed"] == 6  # a text line has no messages: completions, with its own seed
    ids = prompt_ids(recs[0], TOK, chat_kwargs={"enable_thinking": False})
    assert exs[0].ids == tuple(ids + TOK.encode(answer("hi there"), add_special_tokens=False) + [EOS])


def test_429_500_and_timeouts_are_retried(tmp_path):
    recs = _records(6)
    with OpenAIServer(slow_seconds=1.5) as server:
        server.plan[_key(recs[1])] = ["429", "500", "slow"]
        server.plan[_key(recs[4])] = ["503"]
        exs = _run(server, tmp_path, recs, timeout=0.5)
    assert server.requests_for(_key(recs[1])) == 4 and server.requests_for(_key(recs[4])) == 2
    assert [e.ids for e in exs] == [_expected(r) for r in recs]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (["503"] * 9, r"failed 4 times \(last: HTTP 503\)"),
        (["garbage"], "malformed answer from .* not JSON"),
        (["empty"], r"malformed answer from .* no choices\[0\].text"),
        (["400"], "rejected by .*: HTTP 400"),
    ],
)
def test_failure_names_the_prompt_keeps_the_rest_and_resumes(tmp_path, plan, message):
    recs = _records(12)
    bad = recs[7]
    with OpenAIServer() as server:
        server.plan[_key(bad)] = list(plan)
        with pytest.raises(RegenerationError, match=f"data line {bad.line}: .*{message}"):
            _run(server, tmp_path, recs)
    assert not (tmp_path / "key.jsonl").exists()  # nothing half-written
    done = load_partial(tmp_path / "key.partial.jsonl")
    assert 7 not in done and all(done[i].ids == _expected(recs[i]) for i in done)
    with OpenAIServer() as server:  # a healthy server: only the missing prompts are sent
        exs = _run(server, tmp_path, recs)
    assert sorted(k for _, k in server.log) == sorted(_key(recs[i]) for i in range(12) if i not in done)
    assert [e.ids for e in exs] == [_expected(r) for r in recs]


def test_several_served_models_need_a_name(tmp_path):
    with OpenAIServer(models=("a", "b")) as server:
        with pytest.raises(RegenerationError, match="serves 2 models") as err:
            _run(server, tmp_path, _records(2))
        assert "--regenerate-model" in err.value.hint
        exs = _run(server, tmp_path, _records(2), model="b")
    assert len(exs) == 2


def test_torn_last_line_is_dropped_and_damage_is_named(tmp_path):
    f = tmp_path / "k.partial.jsonl"
    good = json.dumps({"index": 0, "ids": [5, 6, 7], "start": 1}) + "\n"
    f.write_text(good + '{"index": 1, "ids": [5')  # a kill in the middle of the second append
    assert list(load_partial(f)) == [0]
    assert f.read_text() == good  # cut back to the last whole line before anything is appended
    f.write_text('{"index": 0, "ids"\n' + good)
    with pytest.raises(RegenerationError, match="k.partial.jsonl:1 is damaged"):
        load_partial(f)


_WORKER = """
import sys
from pathlib import Path
from dflash_zoo.training.data import Record
from dflash_zoo.training.regenerate import Endpoint, Generation, Regenerator
from tests.tiny import tiny_tokenizer
recs = [Record(i + 1, prompt=f"prompt number {i} " + "ab" * (i % 4)) for i in range(int(sys.argv[3]))]
ep = Endpoint(sys.argv[1], concurrency=2, backoff=0.01)
Regenerator(recs, tiny_tokenizer(), ep, Generation(), Path(sys.argv[2])).run()
"""


def test_a_killed_run_resumes_without_redoing_finished_prompts(tmp_path):
    recs = _records(40)
    out = tmp_path / "key.jsonl"
    partial = tmp_path / "key.partial.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with OpenAIServer(delay=0.05) as server:
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, server.url, str(out), "40"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        try:
            for _ in range(3000):  # bounded: ~60 s
                if (partial.is_file() and partial.read_text().count("\n") >= 6) or proc.poll() is not None:
                    break
                time.sleep(0.02)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert not out.exists()
        done = load_partial(partial)
        assert 6 <= len(done) < 40 and all(done[i].ids == _expected(recs[i]) for i in done)
        before = len(server.log)
        exs = _run(server, tmp_path, recs)
    resent = [k for _, k in server.log[before:]]
    assert sorted(resent) == sorted(_key(recs[i]) for i in range(40) if i not in done)
    assert [e.ids for e in exs] == [_expected(r) for r in recs]
    assert read_examples(out) == exs and not partial.exists()
