"""A procedurally generated language pair with real structure (the offline default).

The source side is English-like (SVO: ``the big dog sees a cat``, plural nouns and verb
agreement in ``-s``); the target side is a different language built from it:

- vocabulary mapping: every source word has its own invented target stem;
- word order: the verb moves to the end of its clause (verb-final, as in German
  subordinate clauses), adjectives follow their noun;
- agreement: each target noun has a fixed gender (0/1); the article depends on the
  gender, number and definiteness of its noun, the adjective takes a gender suffix, and
  the verb's suffix depends on the number of the *subject* (not the word next to it);
- an optional relative clause ``that V-s the N`` on the object, also verb-final.

So a model has to learn a lexicon, reordering over a variable distance and long-range
agreement; copying or reversing the source scores near zero BLEU.
"""

from __future__ import annotations

import random

NOUNS = ["dog", "cat", "bird", "man", "woman", "child", "horse", "farmer", "teacher", "king", "queen", "boy",
         "girl", "fish", "doctor", "singer", "baker", "friend", "student", "wolf"]
VERBS = ["see", "like", "follow", "help", "call", "find", "watch", "hear", "greet", "feed", "chase", "know"]
ADJS = ["big", "small", "old", "young", "happy", "tired", "red", "quiet", "brave", "clever"]
_SYLLABLES = ["ka", "lo", "mi", "ru", "te", "zo", "vi", "na", "pe", "su", "do", "ga", "fi", "be", "xu", "ho"]


def _lexicon(words: list[str], rng: random.Random, used: set[str]) -> dict[str, str]:
    """A distinct invented two/three-syllable target stem per source word."""
    out = {}
    for w in words:
        while True:
            stem = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3))))
            if stem not in used:
                used.add(stem)
                out[w] = stem
                break
    return out


class SyntheticLanguage:
    """The fixed grammar of the pair (lexicon and genders come from ``grammar_seed``)."""

    # article[definite][gender][plural]
    ARTICLES = {True: {0: ("le", "lei"), 1: ("da", "dai")}, False: {0: ("un", "unos"), 1: ("una", "unas")}}

    def __init__(self, grammar_seed: int = 1234) -> None:
        rng = random.Random(grammar_seed)
        used: set[str] = set()
        self.noun = _lexicon(NOUNS, rng, used)
        self.verb = _lexicon(VERBS, rng, used)
        self.adj = _lexicon(ADJS, rng, used)
        self.gender = {n: rng.randint(0, 1) for n in NOUNS}

    def _np(self, rng: random.Random) -> tuple[list[str], list[str], bool]:
        """A noun phrase: (source words, target words, plural)."""
        noun, plural, definite = rng.choice(NOUNS), rng.random() < 0.4, rng.random() < 0.6
        adj = rng.choice(ADJS) if rng.random() < 0.5 else None
        det = "the" if definite else ("some" if plural else "a")
        src = [det] + ([adj] if adj else []) + [noun + ("s" if plural else "")]
        g = self.gender[noun]
        tgt = [self.ARTICLES[definite][g][plural], self.noun[noun] + ("en" if plural else "")]
        if adj:
            tgt.append(self.adj[adj] + ("o" if g == 0 else "a"))
        return src, tgt, plural

    def _verb(self, verb: str, plural_subject: bool) -> tuple[str, str]:
        return verb + ("" if plural_subject else "s"), self.verb[verb] + ("ut" if plural_subject else "it")

    def sentence(self, rng: random.Random) -> tuple[str, str]:
        """One (source, target) pair."""
        s_src, s_tgt, s_pl = self._np(rng)
        o_src, o_tgt, o_pl = self._np(rng)
        v_src, v_tgt = self._verb(rng.choice(VERBS), s_pl)
        src, tgt = s_src + [v_src] + o_src, s_tgt + o_tgt
        if rng.random() < 0.3:  # relative clause on the object: "that chases the cat" -> "ke le X Y-it"
            r_src, r_tgt, _ = self._np(rng)
            rv_src, rv_tgt = self._verb(rng.choice(VERBS), o_pl)
            src += ["that", rv_src] + r_src
            tgt += [",", "ke"] + r_tgt + [rv_tgt, ","]
        tgt.append(v_tgt)
        return " ".join(src), " ".join(tgt)


def synthetic_pairs(num: int, seed: int, grammar_seed: int = 1234) -> list[tuple[str, str]]:
    """``num`` pairs of the synthetic language, sampled with ``seed`` (one grammar for all seeds)."""
    lang, rng = SyntheticLanguage(grammar_seed), random.Random(seed)
    return [lang.sentence(rng) for _ in range(num)]


def reverse_pairs(num: int, seed: int, vocab: int = 20, max_words: int = 8) -> list[tuple[str, str]]:
    """Toy task: the target is the source's words in reverse order (a 1-minute sanity check)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]
    out = []
    for _ in range(num):
        src = [rng.choice(words) for _ in range(rng.randint(2, max_words))]
        out.append((" ".join(src), " ".join(reversed(src))))
    return out
