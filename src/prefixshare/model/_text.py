"""Deterministic English-like text: the tokenizer's training corpus and long test/demo documents.

Nothing here imports torch or the Hugging Face stack. The lexicon is fixed (a list of common English words
plus a few thousand pseudo-words built from syllables by a fixed-seed RNG); a caller's ``seed`` only
chooses which words are drawn, so every seed yields text over the same lexicon and any model this package
builds tokenizes any seed's text efficiently.

All randomness comes from :class:`random.Random` instances seeded with strings (hashed with SHA-512 by
Python, independent of ``PYTHONHASHSEED``), so the output is identical across processes and platforms.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

# Function words appear far more often than content words, as in real English.
_FUNCTION_WORDS = """
the of and to a in is that it was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up out them then
she many some so these would other into has more her two like him see time could no make than first been
its who now people my made over did down only way find use may water long little very after word called
just where most know get through back much before go good new write our used me man too any day same
right look think also around another came come work three must because does part even place well such
here take why help put different away again off went old number great tell men say small every found
still between name should home big give air line set own under read last never us left end along while
might next sound below saw something thought both few those always show large often together asked house
world going want school important until form food keep children feet land side without boy once animal
life enough took four head above kind began almost live page got earth need far hand high year mother
light country father let night picture being study second soon story since white ever paper hard near
sentence better best across during today however sure knew try told young sun thing whole hear example
heard several change answer room sea against top turned learn point city play toward five himself usually
money seen car morning given upon family later turn move face door cut done group true leave
""".split()

_CONTENT_WORDS = """
river mountain garden window letter market engine signal harbor forest valley bridge castle village
teacher doctor farmer sailor painter writer builder driver singer worker student captain soldier
merchant traveler stone cloud storm winter summer autumn spring silver golden iron wooden quiet bright
dark gentle narrow broad ancient modern careful sudden simple strange common heavy empty busy distant
open closed warm cold fresh green blue red yellow gray slow quick clever honest patient proud calm
cache memory server replica prefix token request model layer matrix vector buffer network storage block
record report system process method theory result problem question reason season journey machine
island ocean desert meadow orchard kitchen library museum station theater factory office bakery tower
wall road path street field lake pond hill coast shore cliff cave bay harvest festival council
carry build follow open close begin finish bring hold raise lower measure compare explain describe
notice remember forget gather divide share store load send receive cover discover return travel visit
paint plant wander whisper shout listen answer borrow lend teach watch wait climb swim cook clean
""".split()

_SUFFIXES = ("s", "ed", "ing", "er", "ly", "ness", "ment", "al", "ful", "less")

# Syllable parts for pseudo-words (names of people, places and things in the synthetic text).
_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr bl cl fl gl pl sl st sp sk sh ch th".split()
_NUCLEI = "a e i o u a e i o u ai ea ou io".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "t", "m", "nd", "rt", "st", "ck", "ng"]

_LEXICON_SEED = "prefixshare-lexicon-v1"
_N_PSEUDO = 3000


def _pseudo_word(rng: random.Random) -> str:
    n_syllables = rng.choices((1, 2, 3, 4), weights=(2, 5, 3, 1))[0]
    return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(n_syllables))


@functools.lru_cache(maxsize=1)
def _lexicon() -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The fixed word list and its Zipf-like sampling weights (most frequent first)."""
    rng = random.Random(_LEXICON_SEED)
    words: list[str] = []
    seen: set[str] = set()

    def add(word: str) -> None:
        if word not in seen:
            seen.add(word)
            words.append(word)

    for word in _FUNCTION_WORDS:
        add(word)
    for word in _CONTENT_WORDS:
        add(word)
    for word in _CONTENT_WORDS:
        for suffix in _SUFFIXES:
            if rng.random() < 0.4:
                add(word + suffix)
    while len(words) < len(_FUNCTION_WORDS) + len(_CONTENT_WORDS) + _N_PSEUDO:
        add(_pseudo_word(rng))
    weights = tuple(1.0 / (rank + 2.7) ** 1.2 for rank in range(len(words)))
    return tuple(words), weights


class _Writer:
    """Draws sentences and paragraphs of English-like prose from one seeded RNG."""

    def __init__(self, seed: str) -> None:
        self._rng = random.Random(seed)
        self._words, weights = _lexicon()
        # Cumulative weights make each draw O(log n) instead of O(n).
        total = 0.0
        self._cum: list[float] = []
        for weight in weights:
            total += weight
            self._cum.append(total)

    def words(self, n: int) -> list[str]:
        return self._rng.choices(self._words, cum_weights=self._cum, k=n)

    def sentence(self, n_words: int) -> list[str]:
        """``n_words`` words: the first capitalised, maybe a comma, a final punctuation mark."""
        rng = self._rng
        words = self.words(n_words)
        words[0] = words[0].capitalize()
        if n_words >= 8 and rng.random() < 0.4:
            i = rng.randrange(3, n_words - 2)
            words[i] += ","
        if rng.random() < 0.05 and n_words >= 3:
            i = rng.randrange(1, n_words)
            words[i] = words[i].capitalize()
        words[-1] += rng.choices((".", "?", "!", ";", ":"), weights=(85, 7, 4, 2, 2))[0]
        return words

    def sentence_length(self) -> int:
        return max(3, min(30, int(self._rng.gauss(13, 5))))

    def paragraph_length(self) -> int:
        return self._rng.randint(3, 7)


def document_text(n_words: int, seed: int = 0) -> str:
    """Deterministic English-like prose of exactly ``n_words`` whitespace-separated words.

    Sentences are grouped into paragraphs separated by blank lines. The same ``(n_words, seed)`` always
    returns the same string, and texts of one seed share prefixes: ``document_text(n, s)`` is
    ``document_text(m, s)`` (``m > n``) cut after its n-th word, with a full stop put on that word. So two
    prompts built with the same seed share all but the last word of the shorter one, which is what a
    prefix-cache test needs. About 1.3 tokens per word with the tokenizers this package builds.
    """
    if n_words < 0:
        raise ValueError(f"n_words must be >= 0, got {n_words}")
    writer = _Writer(f"prefixshare-document:{seed}")
    paragraphs: list[str] = []
    remaining = n_words
    while remaining > 0:
        sentences: list[str] = []
        for _ in range(writer.paragraph_length()):
            if remaining <= 0:
                break
            # Always draw a whole sentence (keeps the RNG stream independent of n_words), then cut it.
            words = writer.sentence(writer.sentence_length())
            if len(words) > remaining:
                words = words[:remaining]
                words[-1] = words[-1].rstrip(",.?!;:") + "."
            sentences.append(" ".join(words))
            remaining -= len(words)
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def corpus_lines(seed: int, n_lines: int) -> Iterator[str]:
    """Training corpus for the tokenizer: ``n_lines`` paragraphs, plus digits and code-ish lines.

    Every line is drawn from a stream seeded by ``seed``, so the trained tokenizer is a function of it.
    """
    writer = _Writer(f"prefixshare-corpus:{seed}")
    rng = random.Random(f"prefixshare-corpus-extra:{seed}")
    for i in range(n_lines):
        if i % 10 == 9:
            # Numbers, dates and a little markup so such prompts do not fall back to single bytes.
            yield (
                f"{rng.randint(0, 9999)} {rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/"
                f"{rng.randint(1900, 2100)} {rng.random():.4f} - ({' '.join(writer.words(4))}) "
                f"[{rng.randint(0, 99)}] #{rng.randint(1, 500)} x={rng.randint(-50, 50)};"
            )
            continue
        sentences = [" ".join(writer.sentence(writer.sentence_length())) for _ in range(writer.paragraph_length())]
        yield " ".join(sentences)
