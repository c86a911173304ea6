"""Distinct requests of each ``bench.wan_tokens`` workload, for the sustained run (issue 26, 8 mixed streams).

The sustained run keeps 8 clients busy for a fixed window, each starting its next request when the last ends. Were
those requests one prompt repeated, a greedy rerun would draft its whole answer from the last run's output (the
suffix drafts' cross-session store) and measure a cache, not speculation. So every request a client sends in a
window is a different one of these: the same task and shape (the same schema, tool, kind of code edit, kind of
story) with other content, as an agent's or a chat frontend's traffic is. What a workload's requests share (the
schema's keys, the tool's name, Python's keywords) the store may learn from earlier ones; that is what it is for.
"""

from __future__ import annotations

Chat = list[dict[str, str]]

_PEOPLE = [
    ("Maria Lopez", "+34 612 345 678", "Valencia", "Spain"),
    ("Kenji Watanabe", "+81 90 1234 5678", "Osaka", "Japan"),
    ("Amara Okafor", "+234 803 555 0142", "Lagos", "Nigeria"),
    ("Lukas Novak", "+420 601 222 333", "Brno", "Czechia"),
    ("Sofia Rossi", "+39 347 555 0199", "Turin", "Italy"),
    ("Daniel Cohen", "+972 52 555 0137", "Haifa", "Israel"),
    ("Priya Raman", "+91 98450 55512", "Chennai", "India"),
    ("Tomas Lindqvist", "+46 70 555 0181", "Uppsala", "Sweden"),
    ("Chloe Martin", "+33 6 55 55 01 23", "Lyon", "France"),
    ("Mateus Costa", "+55 21 95555 0104", "Recife", "Brazil"),
    ("Hana Kim", "+82 10 5555 0166", "Busan", "South Korea"),
    ("Ewan Fraser", "+44 7700 900461", "Dundee", "Scotland"),
]
_AGES = [41, 29, 57, 34, 63, 25, 48, 38, 52, 31, 45, 60]
_CITIES = [
    "Oslo", "Lisbon", "Nairobi", "Denver", "Hanoi", "Perth", "Montreal", "Krakow", "Lima", "Seoul", "Cairo", "Dublin",
]  # fmt: skip
_STORIES = [
    "a lighthouse keeper and a storm",
    "a baker who finds an old map in a bag of flour",
    "a robot that learns to paint",
    "a lost dog crossing a big city at night",
    "a violinist on a night train",
    "an astronaut who grows a garden on the moon",
    "two rival beekeepers in a mountain village",
    "a clockmaker whose clocks start running backwards",
    "a girl who can hear what trees say",
    "a retired sailor teaching a child to fish",
    "a librarian who finds a letter from the future",
    "a fox and a crow who share a winter",
]
# (function, the parameter to rename, its new names): a first turn's code, then "rename it and show it again"; a
# function's second new name is asked for only once every function has been asked for once
FUNCTIONS = [
    (
        """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
""",
        "values",
        ("samples", "series"),
    ),
    (
        """def running_max(numbers):
    result = []
    best = None
    for number in numbers:
        if best is None or number > best:
            best = number
        result.append(best)
    return result
""",
        "numbers",
        ("readings", "levels"),
    ),
    (
        """def word_counts(text, lowercase=True):
    counts = {}
    for word in text.split():
        word = word.strip(".,;:!?")
        if lowercase:
            word = word.lower()
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
""",
        "text",
        ("document", "passage"),
    ),
    (
        """def chunked(items, size):
    if size < 1:
        raise ValueError("size must be at least 1")
    chunks = []
    for start in range(0, len(items), size):
        chunks.append(items[start:start + size])
    return chunks
""",
        "items",
        ("records", "rows"),
    ),
    (
        """def clamp_all(values, low, high):
    if low > high:
        raise ValueError("low must not exceed high")
    clamped = []
    for value in values:
        clamped.append(min(max(value, low), high))
    return clamped
""",
        "values",
        ("measurements", "inputs"),
    ),
    (
        """def dedupe(entries):
    seen = set()
    unique = []
    for entry in entries:
        if entry not in seen:
            seen.add(entry)
            unique.append(entry)
    return unique
""",
        "entries",
        ("names", "tags"),
    ),
    (
        """def parse_pairs(line, separator="="):
    pairs = {}
    for part in line.split(";"):
        if separator not in part:
            continue
        key, value = part.split(separator, 1)
        pairs[key.strip()] = value.strip()
    return pairs
""",
        "line",
        ("header", "query"),
    ),
    (
        """def median(numbers):
    if not numbers:
        raise ValueError("median of an empty list")
    ordered = sorted(numbers)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
""",
        "numbers",
        ("latencies", "durations"),
    ),
]


def structured(index: int) -> Chat:
    """A customer record to extract as JSON (``CUSTOMER``'s schema in ``bench.wan_tokens``)."""
    turn = index // len(_PEOPLE)  # past the first round of people, each moves to another's city, at another age
    name, phone, _, _ = _PEOPLE[index % len(_PEOPLE)]
    _, _, city, country = _PEOPLE[(index + turn) % len(_PEOPLE)]
    age, vip = _AGES[(index * 5 + turn) % len(_AGES)], index % 3 != 1
    email = name.lower().replace(" ", ".") + "@example.com"
    status = "is a VIP customer" if vip else "is not a VIP customer"
    text = f"Extract the customer as JSON: {name} ({email}, {phone}) lives in {city}, {country}, is {age} and {status}."
    return [{"role": "user", "content": text}]


def tool(index: int) -> Chat:
    """A weather question the forced ``get_weather`` call answers."""
    city = _CITIES[index % len(_CITIES)]  # past the first round of cities, each comes back with other days
    days, unit = 3 + (index * 5) % 7, ("celsius", "fahrenheit")[index % 2]
    hourly = ", hour by hour" if index % 3 != 2 else ", just the daily summary"
    return [{"role": "user", "content": f"What's the weather in {city} for the next {days} days, in {unit}{hourly}?"}]


def agent(index: int) -> Chat:
    """A second turn that re-emits the first turn's function with a parameter renamed."""
    code, old, names = FUNCTIONS[index % len(FUNCTIONS)]
    new = names[(index // len(FUNCTIONS)) % len(names)]
    first = code.split("(")[0].removeprefix("def ")
    return [
        {"role": "user", "content": f"Write a Python function `{first}`."},
        {"role": "assistant", "content": f"```python\n{code}```"},
        {"role": "user", "content": f"Rename `{old}` to `{new}` and show the whole function again."},
    ]


def novel(index: int) -> Chat:
    """A short story on a topic of its own: nothing to copy."""
    return [{"role": "user", "content": f"Write a short story about {_STORIES[index % len(_STORIES)]}."}]


VARIANTS = {"structured": structured, "tool": tool, "agent": agent, "novel": novel}
# requests of each workload that differ (a sustained client sends every other one): in the first run, a tool client
# sent 12 calls a minute, spec on
DISTINCT = {
    "structured": 4 * len(_PEOPLE),
    "tool": 4 * len(_CITIES),
    "agent": 2 * len(FUNCTIONS),
    "novel": len(_STORIES),
}
