"""Multiple-choice scoring: the shared-prefix forward against one forward per choice, and the
choice rules of llama-perplexity (mean log-prob; WinoGrande's partial score)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.engine.evaluation import scoring
from app.engine.evaluation.perplexity import token_nlls
from app.engine.evaluation.scoring import Tokenized
from app.engine.evaluation.tasks import ChoiceTask
from app.engine.model.transformer import load_model
from tests.conftest import GOLDEN


@pytest.fixture(scope="module")
def gemma():
    return load_model(GOLDEN / "gemma3-f32.gguf")


TASKS = [ChoiceTask(["The cat sat on the mat.", "The cat sat on a hat!", "The cat ran"], {0}, 0,
                    "a"),
         ChoiceTask(["Hello world foo", "Hello there bar baz"], {1}, 1, "b"),
         ChoiceTask(["Then it was blue.", "Then it was red."], {0}, 0, "c",
                    ["Then it was blue", "Then it was red"])]


def test_packed_tree_forward_equals_one_forward_per_choice(gemma):
    """Each choice's log-probs from the packed forward (tasks side by side, each prefix once)
    against model.logits of that choice alone. The two run the same float32 operations on
    differently shaped matrices (BLAS may sum in another order): float32's error over this
    model's depth is ~1e-6 relative on logits of size ~10, but gemma3's GELU reads an fp16 table
    (app.engine.kernels.activations), so an input on an fp16 rounding boundary moves a logit by
    up to ~2e-4 (tests/data/golden/README.md, gotcha 3): hence 5e-4."""
    params = gemma.params(llamacpp_numerics=True)
    toks = [scoring.tokenize_task(gemma.tokenizer, t) for t in TASKS]
    assert [t.prefix for t in toks] == [8, 6, 12]
    out = scoring.choice_logprobs(gemma, params, toks, [[(1, 7)], [], [(0, 3)]])
    for t, r, last in zip(toks, out, [(1, 7), None, (0, 3)]):
        for s, seq in enumerate(t.seqs):
            z = gemma.logits(seq)
            want = -token_nlls(z[t.prefix - 1:-1], seq[t.prefix:])
            np.testing.assert_allclose(r["lp"][s], want, atol=5e-4)
        if last is not None:
            z = gemma.logits(t.seqs[last[0]])
            np.testing.assert_allclose(r["last"], -token_nlls(z[-1:], [last[1]]), atol=5e-4)


def test_pack_size_does_not_change_the_scores(gemma, monkeypatch):
    params = gemma.params(llamacpp_numerics=True)
    packed = scoring.score_tasks(gemma, params, "hellaswag", TASKS[:2])
    monkeypatch.setattr(scoring, "PACK_TOKENS", 1)          # one task per forward
    alone = scoring.score_tasks(gemma, params, "hellaswag", TASKS[:2])
    for a, b in zip(packed, alone):
        assert a.choice == b.choice
        np.testing.assert_allclose(a.scores, b.scores, atol=5e-4)


def test_prefix_leaves_every_choice_a_token():
    class Tok:
        def encode(self, text, add_special=True):
            return [0] + [ord(c) for c in text]
    t = scoring.tokenize_task(Tok(), ChoiceTask(["ab", "abc"], {0}, 0, "x"))
    assert t.prefix == 2 and t.seqs == [[0, 97, 98], [0, 97, 98, 99]]


def test_mean_rule_picks_the_first_of_equal_scores():
    t = Tokenized([[1, 2, 3], [1, 2, 4, 5], [1, 2, 6]], 2, [])
    lp = [np.array([-2.0]), np.array([-1.0, -3.0]), np.array([-2.0])]
    s = scoring.pick_mean(t, lp, np.array([]))
    assert s.scores == [-2.0, -2.0, -2.0] and s.raw == [-2.0, -4.0, -2.0] and s.choice == 0


def _wino(seq_lens, prefix, bases):
    return Tokenized([list(range(n)) for n in seq_lens], prefix, bases)


def test_winogrande_partial_score_after_the_option():
    """Both choices have more than 3 tokens after the prefix: each is scored from its base (the
    text up to the option) to the end, its last token left out."""
    t = _wino([10, 11], 4, [6, 7])
    lp = [np.arange(6) * -1.0, np.arange(7) * -1.0]         # tokens 4..9 and 4..10
    s = scoring.pick_winogrande(t, lp, np.array([]))
    # choice 1: tokens 6, 7, 8 (9 is the last) -> lp[0][2:5]; choice 2: tokens 7, 8, 9
    assert s.raw == [-(2 + 3 + 4), -(3 + 4 + 5)]
    assert s.scores == [-3.0, -4.0] and s.choice == 0
    tie = scoring.pick_winogrande(t, [np.zeros(6), np.zeros(7)], np.array([]))
    assert tie.choice == 1                                  # llama.cpp: 1st only if strictly >


def test_winogrande_short_tail_scores_from_the_prefix_with_llamacpps_first_logits():
    """3 tokens or fewer after the prefix: scored from the prefix, and the second choice's first
    token takes the log-prob llama.cpp reads from the first choice's last logits."""
    t = _wino([7, 6], 4, [5, 5])
    assert scoring.winogrande_extra(t) == [(0, t.seqs[1][4])]
    lp = [np.array([-1.0, -2.0, -3.0]), np.array([-5.0, -6.0])]
    s = scoring.pick_winogrande(t, lp, np.array([-0.5]))
    assert s.raw == [-3.0, -0.5] and s.scores == [-1.5, -0.5] and s.choice == 1
    one = scoring.pick_winogrande(_wino([5, 5], 4, [5, 5]), [np.array([-1.0])] * 2,
                                  np.array([-2.0]))
    assert one.raw == [-1.0, -2.0]                         # a single token: kept


def test_accuracy_stderr_is_llamacpps():
    acc = scoring.Accuracy(60, 45)
    assert acc.acc == 0.75 and acc.stderr == pytest.approx(math.sqrt(0.75 * 0.25 / 59))
    assert math.isnan(scoring.Accuracy(1, 1).stderr)
