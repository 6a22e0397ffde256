"""After the engine's warm-up, no request builds a kernel in its step (issue 30).

On MLX's CPU backend every fused elementwise loop is compiled by the system C++ compiler on first use and
kept under $TMPDIR/mlx. With only greedy rows warmed, the first request that sampled (the OpenAI default,
temperature 1) built the Gumbel noise's loops inside its steps: 4.1 s on a fresh 2-core machine, 2.9 s more
for the first two sampled rows, 1.3 s for the first penalties and 2.6 s for the first grammar mask, every
running request waiting. Here an engine warms up in a process of its own with an empty kernel cache, then
runs each way of sampling alone and several together, and no new compiled loop may appear meanwhile; a second
start on the same machine skips the waves that only build loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
from pathlib import Path
from parallm.engine import make_request, warmup
from parallm.protocol import Constraint, SamplingParams
from tests._engine_helpers import make_engine, tiny_model
from tests.test_constraints import EOS, char_tokenizer

cache = Path(sys.argv[1])
ran = []  # the warm-up's waves, by name
run_wave = warmup._wave
warmup._wave = lambda engine, name, *a, **kw: (ran.append(name), run_wave(engine, name, *a, **kw))


def warmed_engine():
    engine = make_engine(tiny_model("llama"), eos=[EOS])
    engine.constraints.use_tokenizer(char_tokenizer())
    engine.warm_up()
    return engine


engine = warmed_engine()
first_waves, ran[:] = list(ran), []
warmed = sorted(p.name for p in cache.rglob("*.so"))
regex = Constraint(kind="regex", value="[a-z]+")
waves = [
    [dict()],                                                               # the OpenAI default: temperature 1
    [dict(), dict(temperature=0.5)],                                        # two sampled rows
    [dict(temperature=0.8, top_p=0.9, top_k=5, min_p=0.05)],               # the filters
    [dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)],
    [dict(repetition_penalty=1.2), dict(temperature=0.0), dict(top_p=0.5)],
    [dict(logprobs=True, top_logprobs=3)],
    [dict(constraint=regex)],                                               # a grammar's mask, sampled
    [dict(constraint=regex, temperature=0.0), dict(constraint=regex), dict()],
]
for w, rows in enumerate(waves):
    for i, kw in enumerate(rows):
        kw = {"max_tokens": 4, "seed": i, "ignore_eos": "constraint" not in kw, **kw}
        engine.add_request(make_request(f"r{w}-{i}", [5 + w, 6, 7 + i, 8, 9], SamplingParams(**kw)))
    while engine.has_work():
        engine.step()
after = sorted(p.name for p in cache.rglob("*.so"))
warmed_engine()  # a second start on this machine: every loop is in the cache
print(json.dumps({"warmed": warmed, "new": sorted(set(after) - set(warmed)), "first_waves": first_waves,
                  "second_waves": ran}))
"""


@pytest.mark.slow
@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="MLX's CPU backend compiles its fused loops on first use")
def test_no_request_builds_a_kernel_after_the_warm_up(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["warmed"], "the warm-up built no loop: the kernel cache is not where this test looks"
    assert found["new"] == [], f"built after the warm-up, inside requests' steps: {found['new']}"
    # the first warm-up on the machine ran every wave; a later start stops after the sampled wave found its loops
    assert found["first_waves"] == ["0", "1", "2", "c0", "c1"]
    assert found["second_waves"] == ["0", "1"]
