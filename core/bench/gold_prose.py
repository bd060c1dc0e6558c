"""The fictional world of the gold workload and the prose that states its facts.

Every name is an invented word built from syllables, unique within a world; a
look-alike changes one vowel (``Velmora`` -> ``Velmara``).  Each fact sentence names
its subject, so a fact is "stated" by a sentence holding the subject and the value.
Years, staff counts and the small counts of the distractors never overlap.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

COLOURS = ("teal", "crimson", "amber", "violet", "olive", "navy", "coral", "ochre", "maroon")
SUFFIXES = ("Tech", "Labs", "Works", "Systems", "Motors", "Instruments", "Textiles", "Foods")
PRODUCT_TYPES = ("drill", "kettle", "lantern", "scanner", "loom", "bicycle", "compass", "heater")
MOTTOS = ("Built to last", "Quiet hands, steady work", "Every part counts", "Light and true")
YEARS = range(1890, 2000)
STAFF = range(2000, 10000, 10)
SMALL_COUNTS = range(3, 90)
_ONSETS = ("b", "br", "d", "dr", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "z")
_VOWELS = "aeiou"
_CODAS = ("", "", "", "l", "n", "r", "s")
_PROFILE = (
    (
        "{c} was founded in {year} by {founder}. ",
        "{founder} founded {c} in {year}, after years of work as an engineer. ",
    ),
    ("{c} has its headquarters in {city}. ", "{c} is headquartered in {city}. "),
    ("{c} employs {staff} people. ", "{c} has a staff of {staff} employees. "),
    ("The logo of {c} is {colour}. ", "{c} uses {colour} for its logo. "),
    (
        "{c} grew slowly through long contracts and careful hiring. ",
        "{c} publishes a short yearly letter to its customers. ",
    ),
    (
        "{c} keeps its workshops open to visitors once a month. ",
        "{c} still answers every letter from a customer by hand. ",
    ),
)
_CATALOGUE = (
    ("The {p} is made by {c}. ", "{c} makes the {p}. "),
    (
        "The {p} sells for {price} crowns and weighs {weight} kilograms. ",
        "Buyers pay {price} crowns for the {p}, which weighs {weight} kilograms. ",
    ),
    (
        "Reviewers praise the {p} for its sturdy frame and simple controls. ",
        "The {p} ships in a plain box with a printed manual and a spare fuse. ",
    ),
    (
        "Spare parts for the {p} are sold separately in most hardware shops. ",
        "A second version of the {p} is planned, with a quieter motor. ",
    ),
)
_COMPANY_NEWS = (
    ("{c} trades under the ticker {ticker} and holds {count} patents. ",),
    ('The motto of {c} is "{motto}". ',),
    ("{c} sponsors the {event} Regatta every spring. ",),
    (
        "Analysts expect {c} to report a quiet quarter with steady orders. ",
        "{c} has opened a small training centre for apprentices. ",
    ),
)
_PRODUCT_NEWS = (
    ("The {p} won the {event} Design Prize, judged by a panel of craftsmen. ",),
    ("A teardown of the {p} found {count} screws and no glue. ",),
    (
        "Owners of the {p} say it needs little care after the first month. ",
        "Some shops have run out of the {p} after a favourable magazine review. ",
    ),
)


@dataclass(frozen=True)
class Company:
    """A company with one product; ``regatta`` and ``prize`` name events in the news."""

    name: str
    year: int
    founder: str
    city: str
    staff: int
    colour: str
    product: str
    regatta: str
    prize: str


class Names:
    """Unique invented words from a seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int = 2) -> str:
        """A new capitalised word of ``syllables`` syllables."""
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
            word = ("".join(parts) + self.rng.choice(_CODAS)).capitalize()
            if word not in self.used:
                self.used.add(word)
                return word

    def look_alike(self, word: str) -> str:
        """A new word that differs from ``word`` in one vowel."""
        spots = [i for i, char in enumerate(word) if char.lower() in _VOWELS]
        while True:
            spot = self.rng.choice(spots)
            vowel = self.rng.choice(_VOWELS.replace(word[spot].lower(), ""))
            other = word[:spot] + (vowel.upper() if spot == 0 else vowel) + word[spot + 1 :]
            if other not in self.used:
                self.used.add(other)
                return other


def make_company(names: Names, rng: random.Random, cities: list[str]) -> Company:
    """A company with random values and new names for itself, founder, product, events."""
    return Company(
        name=f"{names.word()} {rng.choice(SUFFIXES)}",
        year=rng.choice(YEARS),
        founder=f"{names.word()} {names.word()}",
        city=rng.choice(cities),
        staff=rng.choice(STAFF),
        colour=rng.choice(COLOURS),
        product=f"{names.word()} {rng.choice(PRODUCT_TYPES)}",
        regatta=names.word(3),
        prize=names.word(3),
    )


def make_twin(names: Names, rng: random.Random, cities: list[str], real: Company) -> Company:
    """A look-alike of ``real``: one vowel changed in its name and product, every value
    different (founder and events are new names)."""
    stem, suffix = real.name.split(" ")
    product, product_type = real.product.split(" ")
    return Company(
        name=f"{names.look_alike(stem)} {suffix}",
        year=rng.choice([year for year in YEARS if year != real.year]),
        founder=f"{names.word()} {names.word()}",
        city=rng.choice([city for city in cities if city != real.city]),
        staff=rng.choice([staff for staff in STAFF if staff != real.staff]),
        colour=rng.choice([colour for colour in COLOURS if colour != real.colour]),
        product=f"{names.look_alike(product)} {product_type}",
        regatta=names.word(3),
        prize=names.word(3),
    )


def _paragraph(lines: tuple[tuple[str, ...], ...], rng: random.Random, **values: object) -> str:
    return "".join(rng.choice(choices).format(**values) for choices in lines).strip()


def profile(c: Company, rng: random.Random) -> str:
    """Founding year and founder, headquarters, staff and logo colour of ``c``."""
    values = {"c": c.name, "year": c.year, "founder": c.founder, "city": c.city}
    return _paragraph(_PROFILE, rng, staff=f"{c.staff:,}", colour=c.colour, **values)


def catalogue(c: Company, rng: random.Random) -> str:
    """Who makes ``c.product``, its price and weight: no year, city, person or colour."""
    price, weight = rng.randrange(20, 900), rng.randrange(2, 40)
    return _paragraph(_CATALOGUE, rng, c=c.name, p=c.product, price=price, weight=weight)


def company_news(c: Company, rng: random.Random) -> str:
    """Other attributes of ``c`` (ticker, patents, motto, sponsoring), none asked about."""
    ticker = "".join(char for char in c.name.upper() if char.isalpha())[:4]
    count, motto = rng.choice(SMALL_COUNTS), rng.choice(MOTTOS)
    values = {"c": c.name, "ticker": ticker, "count": count, "motto": motto}
    return _paragraph(_COMPANY_NEWS, rng, event=c.regatta, **values)


def product_news(c: Company, rng: random.Random) -> str:
    """Other attributes of ``c.product`` (a prize, a teardown); its maker is not named."""
    count = rng.choice(SMALL_COUNTS)
    return _paragraph(_PRODUCT_NEWS, rng, p=c.product, count=count, event=c.prize)


Writer = Callable[[Company, random.Random], str]
# chunk kind -> (does it describe the look-alikes, is its subject the product, is it a
# profile (longer paragraphs, fewer to a chunk), writer)
CHUNK_KINDS: dict[str, tuple[bool, bool, bool, Writer]] = {
    "profiles": (False, False, True, profile),
    "catalogue": (False, True, False, catalogue),
    "look-alike profiles": (True, False, True, profile),
    "look-alike catalogue": (True, True, False, catalogue),
    "company news": (False, False, False, company_news),
    "product news": (False, True, False, product_news),
}
