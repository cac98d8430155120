"""The Porter stemmer exactly as Lucene's ``PorterStemmer`` applies it (Porter's reference code).

Why not a library: Snowball's ``porter`` follows the 1980 paper, while Lucene copies Martin Porter's
reference implementation, which departs from the paper (step 2 maps BLI to BLE instead of ABLI to
ABLE and adds LOGI to LOG) and from Snowball (step 1b undoes *any* doubled consonant but l, s, z
after removing -ed/-ing, not only bb, dd, ff, gg, mm, nn, pp, rr, tt). Patching a library's output
afterwards cannot tell in which step a suffix appeared ("paléontologie" loses its -e only in the last
step, after LOGI would have applied), so this module implements the algorithm itself, written from
the published description and the documented departures.

Conventions that match Lucene's: only a, e, i, o, u are vowels, and y is one after a consonant;
every other character, accented or not, is a consonant; the word is a sequence of UTF-16 code units
(what a Java ``char[]`` holds), and words of at most two units are left alone.
"""

from __future__ import annotations

__all__ = ["porter_stem"]

_VOWELS = frozenset("aeiou")


class _Word:
    """The reference algorithm's state: buffer ``b``, end ``k`` (inclusive), and the stem end ``j``."""

    __slots__ = ("b", "j", "k")

    def __init__(self, word: str) -> None:
        self.b = list(word)
        self.k = len(self.b) - 1
        self.j = 0

    def cons(self, i: int) -> bool:
        ch = self.b[i]
        if ch in _VOWELS:
            return False
        if ch == "y":
            return True if i == 0 else not self.cons(i - 1)
        return True

    def m(self) -> int:
        """The number of vowel-consonant sequences in b[0..j]."""
        n, i, j = 0, 0, self.j
        while True:
            if i > j:
                return n
            if not self.cons(i):
                break
            i += 1
        i += 1
        while True:
            while True:
                if i > j:
                    return n
                if self.cons(i):
                    break
                i += 1
            i += 1
            n += 1
            while True:
                if i > j:
                    return n
                if not self.cons(i):
                    break
                i += 1
            i += 1

    def vowel_in_stem(self) -> bool:
        return any(not self.cons(i) for i in range(self.j + 1))

    def double_cons(self, j: int) -> bool:
        return j >= 1 and self.b[j] == self.b[j - 1] and self.cons(j)

    def cvc(self, i: int) -> bool:
        if i < 2 or not self.cons(i) or self.cons(i - 1) or not self.cons(i - 2):
            return False
        return self.b[i] not in "wxy"

    def ends(self, suffix: str) -> bool:
        n = len(suffix)
        start = self.k - n + 1
        if start < 0 or "".join(self.b[start : self.k + 1]) != suffix:
            return False
        self.j = self.k - n
        return True

    def set_to(self, text: str) -> None:
        self.b[self.j + 1 :] = list(text)
        self.k = self.j + len(text)

    def r(self, text: str) -> None:
        if self.m() > 0:
            self.set_to(text)

    def __str__(self) -> str:
        return "".join(self.b[: self.k + 1])


def _step1(w: _Word) -> None:  # plurals, -ed, -ing
    b = w.b
    if b[w.k] == "s":
        if w.ends("sses"):
            w.k -= 2
        elif w.ends("ies"):
            w.set_to("i")
        elif b[w.k - 1] != "s":
            w.k -= 1
        del b[w.k + 1 :]
    if w.ends("eed"):
        if w.m() > 0:
            w.k -= 1
            del b[w.k + 1 :]
    elif (w.ends("ed") or w.ends("ing")) and w.vowel_in_stem():
        w.k = w.j
        del b[w.k + 1 :]
        if w.ends("at"):
            w.set_to("ate")
        elif w.ends("bl"):
            w.set_to("ble")
        elif w.ends("iz"):
            w.set_to("ize")
        elif w.double_cons(w.k):
            if b[w.k] not in "lsz":
                w.k -= 1
                del b[w.k + 1 :]
        elif w.m() == 1 and w.cvc(w.k):
            w.set_to("e")


def _step2(w: _Word) -> None:  # terminal y to i when there is another vowel
    if w.ends("y") and w.vowel_in_stem():
        w.b[w.k] = "i"


# Steps 3 and 4: the first suffix that matches is the only one tried (replaced if m > 0), as in the
# reference code's switch on the penultimate (step 3) or last (step 4) letter.
_STEP3 = {
    "a": (("ational", "ate"), ("tional", "tion")),
    "c": (("enci", "ence"), ("anci", "ance")),
    "e": (("izer", "ize"),),
    "l": (("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous")),
    "o": (("ization", "ize"), ("ation", "ate"), ("ator", "ate")),
    "s": (("alism", "al"), ("iveness", "ive"), ("fulness", "ful"), ("ousness", "ous")),
    "t": (("aliti", "al"), ("iviti", "ive"), ("biliti", "ble")),
    "g": (("logi", "log"),),
}
_STEP4 = {
    "e": (("icate", "ic"), ("ative", ""), ("alize", "al")),
    "i": (("iciti", "ic"),),
    "l": (("ical", "ic"), ("ful", "")),
    "s": (("ness", ""),),
}
_STEP5 = {
    "a": ("al",),
    "c": ("ance", "ence"),
    "e": ("er",),
    "i": ("ic",),
    "l": ("able", "ible"),
    "n": ("ant", "ement", "ment", "ent"),
    "s": ("ism",),
    "t": ("ate", "iti"),
    "u": ("ous",),
    "v": ("ive",),
    "z": ("ize",),
}


def _replace_first(w: _Word, rules: tuple[tuple[str, str], ...]) -> None:
    for suffix, replacement in rules:
        if w.ends(suffix):
            w.r(replacement)
            del w.b[w.k + 1 :]
            return


def _step3(w: _Word) -> None:
    if w.k >= 1:
        _replace_first(w, _STEP3.get(w.b[w.k - 1], ()))


def _step4(w: _Word) -> None:
    _replace_first(w, _STEP4.get(w.b[w.k], ()))


def _step5(w: _Word) -> None:  # -ant, -ence, ... removed when m > 1
    if w.k < 1:
        return
    key = w.b[w.k - 1]
    if key == "o":
        matched = (w.ends("ion") and w.j >= 0 and w.b[w.j] in "st") or w.ends("ou")
    else:
        matched = any(w.ends(suffix) for suffix in _STEP5.get(key, ()))
    if matched and w.m() > 1:
        w.k = w.j
        del w.b[w.k + 1 :]


def _step6(w: _Word) -> None:  # a final -e, and -ll to -l
    w.j = w.k
    if w.b[w.k] == "e":
        a = w.m()
        if a > 1 or (a == 1 and not w.cvc(w.k - 1)):
            w.k -= 1
    if w.b[w.k] == "l" and w.double_cons(w.k) and w.m() > 1:
        w.k -= 1
    del w.b[w.k + 1 :]


def _stem_units(word: str) -> str:
    w = _Word(word)
    if w.k > 1:
        for step in (_step1, _step2, _step3, _step4, _step5, _step6):
            step(w)
    return str(w)


def porter_stem(word: str) -> str:
    """Lucene's Porter stem of a lower-cased ``word``."""
    if word.isascii() or all(ord(ch) <= 0xFFFF for ch in word):
        return _stem_units(word)
    # Outside the BMP, Java sees two code units per character: stem those, then join them again.
    units = word.encode("utf-16-le", "surrogatepass")
    chars = "".join(chr(int.from_bytes(units[i : i + 2], "little")) for i in range(0, len(units), 2))
    stem = _stem_units(chars)
    return stem.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
