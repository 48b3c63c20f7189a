"""A procedurally generated tool space: thousands of functions the embedded model must read.

The catalogue (catalogue.py) has 24 functions with fixed names; a model trained only on them
recalls names. Here a function is composed: a verb ("create", "cancel", ...), an object
("invoice", "support ticket", ...) and 1-3 parameters, each an argument *concept* (a person's
name, a date, a priority, a list of tags, ...) under one of several parameter names. Names,
descriptions and request wordings all derive from those parts, so choosing a function means
matching the request's verb and object to a tool's name and description, and filling it means
copying each value into the parameter whose description fits.

Held out from training, as whole functions (`split="unseen"`): every (verb, object) pair whose
hash falls in 1 of 8, every function of the HELDOUT_OBJECTS (nouns no trained tool carries), and
the last parameter name of every concept (an unseen function has at least one). Requests that no
offered tool fits (decoys share the request's verb or its object) teach the model to answer
instead of calling.

Training also renames (`RENAME_PARAM`, `MADE_UP_OBJECT`): some parameters go under names composed
on the fly and some objects are made-up words, so a name can only be got right by copying it from
the offered schema or the request, never by recalling it; an unseen function needs exactly that.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from . import catalogue as C


def _h(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


# ----------------------------------------------------------------------------- argument concepts
@dataclass(frozen=True)
class Concept:
    key: str
    type: str  # JSON schema type: string, integer, number, boolean, array
    names: tuple[str, ...]  # parameter names; the last is used by unseen functions only
    description: str
    mentions: tuple[str, ...]  # how a request carries the value: "{v}" is its text
    sample: Callable[[random.Random], Any]
    enum: tuple[str, ...] | None = None
    false_mentions: tuple[str, ...] = ()  # booleans: how a request says no


def _code(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
    return f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(100, 9999)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2025, 2028)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _email(rng: random.Random) -> str:
    return f"{rng.choice(C.NAMES).lower()}.{C.made_up_word(rng).lower()}@example.com"


def _title(rng: random.Random) -> str:
    return rng.choice(C.TOPICS) if rng.random() < 0.6 else f"{rng.choice(C.TOPICS)} {C.made_up_word(rng)}"


def _name(rng: random.Random) -> str:
    return rng.choice(C.NAMES) if rng.random() < 0.75 else C.made_up_word(rng)


def _amount(rng: random.Random) -> float | int:
    text = C.GENERATED["amount"](rng)
    return float(text) if "." in text else int(text)


def _some(pool, lo: int = 2, hi: int = 3):
    return lambda rng: rng.sample(list(pool), rng.randint(lo, hi))


CONCEPTS: dict[str, Concept] = {c.key: c for c in [
    Concept("person", "string", ("name", "person", "contact", "customer_name"), "Name of the person",
            ("for {v}", "for {v}", "for my contact {v}"), _name),
    Concept("city", "string", ("city", "location", "town", "place_name"), "City name",
            ("in {v}", "in {v}", "for the city of {v}"), lambda r: r.choice(C.CITIES)),
    Concept("title", "string", ("title", "label", "subject", "heading"), "Short title",
            ("called {v}", "titled {v}", "named {v}"), _title),
    Concept("code", "string", ("id", "code", "reference", "record_key"), "Identifier such as AB-1234",
            ("{v}", "with the id {v}", "number {v}"), _code),
    Concept("email", "string", ("email", "address", "email_address", "inbox"), "Email address",
            ("at {v}", "using the address {v}"), _email),
    Concept("date", "string", ("date", "day", "due_date", "on_date"), "Date as YYYY-MM-DD",
            ("on {v}", "for {v}", "dated {v}"), _date),
    Concept("language", "string", ("language", "lang", "locale", "spoken_language"), "Language name",
            ("in {v}",), lambda r: r.choice(C.LANGUAGES)),
    Concept("message", "string", ("message", "text", "body", "content_text"), "The text to use",
            ("saying \"{v}\"", "with the text \"{v}\""), lambda r: r.choice(C.PHRASES)),
    Concept("query", "string", ("query", "keywords", "search_terms", "lookup_phrase"), "What to look for",
            ("about {v}", "matching {v}"), lambda r: r.choice(C.SEARCH_TOPICS)),
    Concept("quantity", "integer", ("quantity", "count", "units", "copies"), "How many",
            ("{v} units", "a quantity of {v}", "{v} copies"), lambda r: r.randint(1, 50)),
    Concept("days", "integer", ("days", "num_days", "duration_days", "day_span"), "Number of days",
            ("for {v} days",), lambda r: r.randint(1, 90)),
    Concept("minutes", "integer", ("minutes", "duration", "length_minutes", "mins_total"), "Duration in minutes",
            ("for {v} minutes", "lasting {v} minutes"), lambda r: r.randint(5, 240)),
    Concept("limit", "integer", ("limit", "max_results", "top_n", "how_many"), "Maximum number of results",
            ("top {v}", "at most {v} of them"), lambda r: r.randint(1, 25)),
    Concept("year", "integer", ("year", "yr", "calendar_year", "for_year"), "Year",
            ("from {v}", "for the year {v}"), lambda r: r.randint(1990, 2030)),
    Concept("guests", "integer", ("guests", "seats", "people", "party_size"), "Number of people",
            ("for {v} people", "for a group of {v}"), lambda r: r.randint(1, 12)),
    Concept("rating", "integer", ("rating", "stars", "score", "grade_value"), "Rating from 1 to 5",
            ("with {v} stars", "rated {v}"), lambda r: r.randint(1, 5)),
    Concept("amount", "number", ("amount", "value", "sum", "total_amount"), "Amount of money",
            ("of {v}", "worth {v}", "for an amount of {v}"), _amount),
    Concept("price", "number", ("max_price", "price", "budget", "price_cap"), "Highest price",
            ("under {v}", "costing at most {v}"), _amount),
    Concept("temperature", "number", ("temperature", "degrees", "target_temp", "setpoint"),
            "Temperature in degrees Celsius", ("to {v} degrees", "at {v} degrees"),
            lambda r: r.randint(5, 30) if r.random() < 0.7 else r.randint(50, 300) / 10),
    Concept("weight", "number", ("weight_kg", "weight", "mass", "kilograms"), "Weight in kilograms",
            ("weighing {v} kg",), lambda r: r.randint(1, 80)),
    Concept("priority", "string", ("priority", "importance", "level", "urgency_level"), "Priority",
            ("with {v} priority", "at {v} priority"), lambda r: r.choice(("low", "medium", "high", "critical")),
            enum=("low", "medium", "high", "critical")),
    Concept("format", "string", ("format", "file_type", "output_format", "export_as"), "File format",
            ("as {v}", "in {v} format"), lambda r: r.choice(("pdf", "csv", "json", "xlsx", "txt")),
            enum=("pdf", "csv", "json", "xlsx", "txt")),
    Concept("size", "string", ("size", "portion", "package_size", "size_class"), "Size",
            ("in size {v}", "size {v}"), lambda r: r.choice(("small", "medium", "large")),
            enum=("small", "medium", "large")),
    Concept("color", "string", ("color", "colour", "shade", "hue"), "Color",
            ("in {v}", "colored {v}"), lambda r: r.choice(("red", "blue", "green", "yellow", "black", "white")),
            enum=("red", "blue", "green", "yellow", "black", "white")),
    Concept("status", "string", ("status", "state", "stage", "phase"), "Status",
            ("marked {v}", "with status {v}"), lambda r: r.choice(("open", "closed", "pending", "done")),
            enum=("open", "closed", "pending", "done")),
    Concept("mode", "string", ("mode", "setting", "preset", "program"), "Operating mode",
            ("in {v} mode",), lambda r: r.choice(("eco", "normal", "turbo", "quiet", "auto")),
            enum=("eco", "normal", "turbo", "quiet", "auto")),
    Concept("notify", "boolean", ("notify", "send_notification", "alert", "announce"),
            "Whether to notify people", ("and notify everyone", "and send a notification"),
            lambda r: r.random() < 0.5, false_mentions=("without notifying anyone", "with no notification")),
    Concept("public", "boolean", ("public", "is_public", "shared", "visible_to_all"),
            "Whether everyone can see it", ("and make it public", "visible to everyone"),
            lambda r: r.random() < 0.5, false_mentions=("and keep it private", "visible only to me")),
    Concept("urgent", "boolean", ("urgent", "is_urgent", "rush", "express"),
            "Whether it is urgent", ("as an urgent one", "and it is urgent"),
            lambda r: r.random() < 0.5, false_mentions=("as a non-urgent one", "and it is not urgent")),
    Concept("archived", "boolean", ("include_archived", "archived", "with_archived", "show_archived"),
            "Whether to include archived items", ("including archived ones",),
            lambda r: r.random() < 0.5, false_mentions=("without archived ones", "excluding archived ones")),
    Concept("recurring", "boolean", ("recurring", "repeat", "repeating", "every_week"),
            "Whether it repeats every week", ("every week", "as a weekly one"),
            lambda r: r.random() < 0.5, false_mentions=("just once", "only one time")),
    Concept("tags", "array", ("tags", "labels", "categories", "tag_list"), "List of tags",
            ("tagged {v}", "with the tags {v}"), _some(C.NEWS_TOPICS)),
    Concept("people", "array", ("attendees", "participants", "members", "invitees"), "List of people",
            ("with {v}", "including {v}"), _some(C.NAMES)),
    Concept("items", "array", ("items", "products", "dishes", "line_items"), "List of items",
            ("with {v}", "containing {v}"), _some(C.FOODS)),
]}


# ----------------------------------------------------------------------------- verbs and objects
@dataclass(frozen=True)
class Verb:
    key: str  # the word in function names
    description: str  # "Create a new {o}." ({o}: the object with its article, {os}: its plural)
    requests: tuple[str, ...]  # request openings: "{o}" / "{os}" / "the {o}" placed by the text
    plural: bool = False  # the request names the object in the plural
    past: str = ""  # for the answer after the tool ran ("" = a read, answered with the result)


VERBS: dict[str, Verb] = {v.key: v for v in [
    Verb("get", "Get one {o} and its details.", ("get the {o}", "show me the {o}", "look up the {o}")),
    Verb("create", "Create a new {o}.", ("create a new {o}", "make a new {o}", "set up a new {o}"), past="created"),
    Verb("delete", "Delete a {o} for good.", ("delete the {o}", "remove the {o}", "erase the {o}"), past="deleted"),
    Verb("update", "Update an existing {o}.", ("update the {o}", "change the {o}", "edit the {o}"), past="updated"),
    Verb("list", "List {os}.", ("list the {os}", "list all {os}", "give me a list of {os}"), plural=True),
    Verb("search", "Search {os} by their contents.", ("search the {os}", "search through the {os}"), plural=True),
    Verb("cancel", "Cancel a {o}.", ("cancel the {o}", "call off the {o}"), past="cancelled"),
    Verb("share", "Share a {o} with others.", ("share the {o}", "pass on the {o}"), past="shared"),
    Verb("export", "Export a {o} to a file.", ("export the {o}", "download the {o} as a file"), past="exported"),
    Verb("archive", "Move a {o} to the archive.", ("archive the {o}", "put the {o} in the archive"), past="archived"),
    Verb("restore", "Restore a {o} from the archive.", ("restore the {o}", "bring back the {o}"), past="restored"),
    Verb("rename", "Give a {o} a new name.", ("rename the {o}", "give the {o} a new name"), past="renamed"),
    Verb("count", "Count {os}.", ("count the {os}", "tell me how many {os} there are"), plural=True),
    Verb("schedule", "Schedule a {o} for later.", ("schedule a {o}", "plan a {o}"), past="scheduled"),
    Verb("approve", "Approve a {o}.", ("approve the {o}", "sign off the {o}"), past="approved"),
    Verb("reject", "Reject a {o}.", ("reject the {o}", "turn down the {o}"), past="rejected"),
    Verb("assign", "Assign a {o} to someone.", ("assign the {o}", "hand over the {o}"), past="assigned"),
    Verb("print", "Print a {o}.", ("print the {o}", "print out the {o}"), past="printed"),
    Verb("duplicate", "Make a copy of a {o}.", ("duplicate the {o}", "make a copy of the {o}"), past="duplicated"),
    Verb("track", "Track where a {o} is.", ("track the {o}", "follow the {o}"), ),
    Verb("pause", "Pause a running {o}.", ("pause the {o}", "put the {o} on hold"), past="paused"),
    Verb("resume", "Resume a paused {o}.", ("resume the {o}", "continue the {o}"), past="resumed"),
    Verb("rate", "Rate a {o}.", ("rate the {o}", "give a rating to the {o}"), past="rated"),
    Verb("renew", "Renew a {o}.", ("renew the {o}", "extend the {o}"), past="renewed"),
    Verb("lock", "Lock a {o}.", ("lock the {o}",), past="locked"),
    Verb("unlock", "Unlock a {o}.", ("unlock the {o}",), past="unlocked"),
    Verb("check", "Check the status of a {o}.", ("check the {o}", "check on the {o}")),
    Verb("book", "Book a {o}.", ("book a {o}", "reserve a {o}"), past="booked"),
    Verb("send", "Send a {o}.", ("send a {o}", "send off a {o}"), past="sent"),
    Verb("translate", "Translate a {o} into another language.", ("translate the {o}",), past="translated"),
]}


@dataclass(frozen=True)
class Obj:
    words: str  # as a request writes it: "support ticket"
    plural: str
    verbs: str  # which verbs make sense, space-separated
    concepts: str  # which argument concepts fit, space-separated; the first identifies one


def _o(words, plural, verbs, concepts):
    return Obj(words, plural, verbs, concepts)


_ALL_EDIT = "get create delete update list archive restore rename"
OBJECTS: list[Obj] = [
    _o("invoice", "invoices", f"{_ALL_EDIT} send export approve reject print duplicate count",
       "code person amount date format notify status"),
    _o("support ticket", "support tickets", f"{_ALL_EDIT} assign search count check",
       "code title priority message person status urgent"),
    _o("playlist", "playlists", f"{_ALL_EDIT} share duplicate export", "title tags public people"),
    _o("meeting", "meetings", f"{_ALL_EDIT} schedule cancel count", "title date people minutes recurring city"),
    _o("table reservation", "table reservations", "get create cancel update list book count",
       "person guests date city"),
    _o("hotel room", "hotel rooms", "get book cancel list search count", "city date days guests price"),
    _o("rental car", "rental cars", "get book cancel list search renew", "city date days size price"),
    _o("parcel", "parcels", "get send track list count check", "code email weight city urgent"),
    _o("shipment", "shipments", "get create track cancel list count approve", "code city weight date items"),
    _o("expense report", "expense reports", f"{_ALL_EDIT} approve reject export print",
       "code amount date person format"),
    _o("purchase order", "purchase orders", f"{_ALL_EDIT} approve reject count print", "code items amount person urgent"),
    _o("grocery list", "grocery lists", f"{_ALL_EDIT} share duplicate print", "title items people"),
    _o("recipe", "recipes", f"{_ALL_EDIT} search share rate print translate", "title items query guests language"),
    _o("workout plan", "workout plans", f"{_ALL_EDIT} pause resume share", "title days minutes mode"),
    _o("note", "notes", f"{_ALL_EDIT} search share export print translate", "title message tags public language"),
    _o("task", "tasks", f"{_ALL_EDIT} assign count check", "title date priority person status"),
    _o("project", "projects", f"{_ALL_EDIT} share export count", "title people date status public"),
    _o("calendar event", "calendar events", f"{_ALL_EDIT} schedule cancel count", "title date minutes city recurring people"),
    _o("contact", "contacts", f"{_ALL_EDIT} search share export count", "person email city tags"),
    _o("email draft", "email drafts", f"{_ALL_EDIT} send translate print", "title email message language"),
    _o("newsletter", "newsletters", f"{_ALL_EDIT} send schedule pause resume", "title date message tags"),
    _o("blog post", "blog posts", f"{_ALL_EDIT} search share rate translate", "title message tags public language"),
    _o("photo album", "photo albums", f"{_ALL_EDIT} share export", "title people public date"),
    _o("video", "videos", "get delete update list search share rate export count", "title tags public query"),
    _o("podcast episode", "podcast episodes", "get list search rate share count", "title query year limit"),
    _o("movie ticket", "movie tickets", "get book cancel list count", "title date guests city"),
    _o("train ticket", "train tickets", "get book cancel list count print", "city date guests price"),
    _o("flight booking", "flight bookings", "get book cancel list check print", "code city date guests"),
    _o("subscription", "subscriptions", "get create cancel list renew pause resume count", "code title amount days"),
    _o("coupon", "coupons", "get create delete list count", "code amount date days"),
    _o("refund", "refunds", "get create approve reject list count", "code amount person message"),
    _o("payment", "payments", "get create cancel list search count approve", "code amount person date"),
    _o("bank transfer", "bank transfers", "get create cancel list schedule approve", "code amount person date urgent"),
    _o("budget", "budgets", f"{_ALL_EDIT} export share", "title amount year tags"),
    _o("password", "passwords", "get create delete update list", "title email days"),
    _o("user account", "user accounts", f"{_ALL_EDIT} lock unlock count", "person email status public"),
    _o("team", "teams", f"{_ALL_EDIT} count", "title people city"),
    _o("job posting", "job postings", f"{_ALL_EDIT} search share approve count", "title city amount date public"),
    _o("job application", "job applications", "get create list approve reject count check", "code person title date"),
    _o("vacation request", "vacation requests", "get create cancel list approve reject count", "person date days message"),
    _o("work shift", "work shifts", "get create delete list assign count", "person date minutes city"),
    _o("doctor appointment", "doctor appointments", "get book cancel list schedule", "person date city minutes"),
    _o("prescription", "prescriptions", "get create renew list check", "code person days quantity"),
    _o("vet visit", "vet visits", "get book cancel list schedule", "person date minutes message"),
    _o("course", "courses", "get create delete update list search rate count", "title language days price"),
    _o("homework assignment", "homework assignments", f"{_ALL_EDIT} assign count check", "title date person message"),
    _o("exam", "exams", "get create delete update list schedule count", "title date minutes city"),
    _o("library book", "library books", "get list search renew count check", "title query person days"),
    _o("museum tour", "museum tours", "get book cancel list search", "city date guests language"),
    _o("concert", "concerts", "get list search book count", "city date price query"),
    _o("sensor", "sensors", "get list update check count lock unlock", "code city mode"),
    _o("thermostat", "thermostats", "get update check lock unlock", "city temperature mode"),
    _o("light", "lights", "get update list check count", "title color mode"),
    _o("door lock", "door locks", "get lock unlock check list", "code title"),
    _o("printer", "printers", "get list check pause resume update", "title city mode"),
    _o("backup", "backups", "get create delete list restore schedule count", "title date days format"),
    _o("database", "databases", "get create delete list export count", "title size city format"),
    _o("server", "servers", "get create delete list check pause resume count", "title city size mode"),
    _o("code repository", "code repositories", f"{_ALL_EDIT} search share count", "title public tags people"),
    _o("pull request", "pull requests", "get create list approve reject assign count check", "code title person message"),
    _o("bug report", "bug reports", f"{_ALL_EDIT} assign search count", "code title priority message status"),
    _o("chat channel", "chat channels", f"{_ALL_EDIT} share count", "title people public"),
    _o("poll", "polls", "get create delete list share count", "title items date public"),
    _o("survey", "surveys", f"{_ALL_EDIT} send share export count", "title date people format"),
    _o("wishlist", "wishlists", f"{_ALL_EDIT} share", "title items public"),
    _o("shopping cart", "shopping carts", "get update delete check", "items code"),
    _o("product review", "product reviews", "get create delete list rate count", "title rating message person"),
    _o("gift card", "gift cards", "get create send list check", "code amount email message"),
    _o("loyalty card", "loyalty cards", "get create renew list check", "code person email"),
    _o("parking spot", "parking spots", "get book cancel list search", "city date minutes price"),
    _o("bike rental", "bike rentals", "get book cancel list renew", "city minutes size"),
    _o("taxi ride", "taxi rides", "get book cancel list track", "city date guests"),
    _o("delivery", "deliveries", "get create track cancel list count", "code city items date urgent"),
    _o("inventory item", "inventory items", f"{_ALL_EDIT} search count", "code title quantity city"),
    _o("warehouse", "warehouses", "get create update list count", "title city size"),
    _o("garden bed", "garden beds", "get create update list", "title size days"),
    _o("pet profile", "pet profiles", f"{_ALL_EDIT} share", "person title weight"),
    _o("sleep log", "sleep logs", "get create delete list export", "date minutes rating"),
    _o("meal plan", "meal plans", f"{_ALL_EDIT} share print", "title items days guests"),
    _o("travel itinerary", "travel itineraries", f"{_ALL_EDIT} share print export translate",
       "title city date days language"),
    _o("insurance claim", "insurance claims", "get create list approve reject check", "code amount date message"),
    _o("tax return", "tax returns", "get create update export print check", "year amount person format"),
    _o("loan application", "loan applications", "get create list approve reject check", "code amount person days"),
    _o("donation", "donations", "get create list count cancel", "amount person date recurring"),
    _o("volunteer shift", "volunteer shifts", "get book cancel list assign", "person date city minutes"),
    _o("conference talk", "conference talks", f"{_ALL_EDIT} schedule rate", "title person minutes date"),
    _o("podcast", "podcasts", "get create list search rate share", "title tags language"),
    _o("spreadsheet", "spreadsheets", f"{_ALL_EDIT} share export print", "title format people"),
    _o("slide deck", "slide decks", f"{_ALL_EDIT} share export print translate", "title format language"),
]

# Nouns no trained tool carries: every function on them is unseen.
HELDOUT_OBJECTS = {"garden bed", "insurance claim", "bike rental", "poll", "vet visit",
                   "museum tour", "slide deck", "loyalty card", "sleep log", "warehouse"}


# ----------------------------------------------------------------------------- training-only names
RENAME_PARAM = 0.5  # share of a training tool's parameters under a name composed on the fly
MADE_UP_OBJECT = 0.25  # share of the functions a training request asks for whose object is made up
_PREFIXES = ("new", "target", "primary", "requested", "main", "selected", "desired", "given",
             "input", "chosen", "preferred", "wanted", "my", "the", "which")
_SUFFIXES = ("value", "text", "field", "param", "arg", "info", "entry", "data", "spec", "str", "input")
HELDOUT_PARAM_NAMES = frozenset(c.names[-1] for c in CONCEPTS.values())


def composed_param_name(concept: Concept, rng: random.Random) -> str:
    """A parameter name for `concept` that no fixed list holds: a trained name with a prefix or
    a suffix ("target_city", "quantity_value"), or a made-up word; never a held-out name."""
    while True:
        core, r = rng.choice(concept.names[:-1]), rng.random()
        if r < 0.4:
            name = f"{rng.choice(_PREFIXES)}_{core}"
        elif r < 0.8:
            name = f"{core}_{rng.choice(_SUFFIXES)}"
        else:
            name = C.made_up_word(rng).lower()
        if name not in HELDOUT_PARAM_NAMES:
            return name


def made_up_object(obj: Obj, rng: random.Random) -> Obj:
    """`obj`'s verbs and argument concepts under a made-up noun ("a new zuvaleth")."""
    word = C.made_up_word(rng).lower()
    return Obj(word, word + "s", obj.verbs, obj.concepts)


def _rename(split: str) -> float:
    return RENAME_PARAM if split == "train" else 0.0


def _name_of(verb: str, obj: Obj) -> str:
    return f"{verb}_{(obj.plural if VERBS[verb].plural else obj.words).replace(' ', '_')}"


def unseen_pair(verb: str, obj: Obj) -> bool:
    return obj.words in HELDOUT_OBJECTS or _h(f"{verb}|{obj.words}") % 8 == 0


@dataclass(frozen=True)
class Tool:
    """One generated function: what is offered, and how a request for it reads."""
    verb: str
    obj: Obj
    params: tuple[tuple[str, str], ...]  # (concept key, parameter name)
    name: str
    description: str

    def schema(self) -> dict:
        props, required = {}, []
        for key, pname in self.params:
            c = CONCEPTS[key]
            prop: dict[str, Any] = {"type": c.type, "description": c.description}
            if c.enum:
                prop["enum"] = list(c.enum)
            if c.type == "array":
                prop["items"] = {"type": "string"}
            props[pname] = prop
            required.append(pname)
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": props, "required": required}}}


def _article(words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def make_tool(verb: str, obj: Obj, rng: random.Random, split: str, rename: float = 0.0) -> Tool:
    """A function for (verb, obj): 1-3 of the object's concepts, each under one of its names
    (a share `rename` under a composed one instead)."""
    concepts = obj.concepts.split()
    n = rng.choices((1, 2, 3), weights=(0.35, 0.45, 0.2))[0]
    picked = [concepts[0]] if verb in ("get", "delete", "cancel", "track", "check") else []
    rest = [c for c in concepts if c not in picked]
    picked += rng.sample(rest, min(len(rest), n - len(picked)))
    params = []
    for key in picked:
        names = CONCEPTS[key].names
        pool = names if split == "unseen" else names[:-1]
        params.append((key, rng.choice(pool)))
    if split == "unseen" and not any(p == CONCEPTS[k].names[-1] for k, p in params):
        k = rng.randrange(len(params))
        params[k] = (params[k][0], CONCEPTS[params[k][0]].names[-1])
    if rename:
        params = [(key, composed_param_name(CONCEPTS[key], rng) if rng.random() < rename else p)
                  for key, p in params]
    v = VERBS[verb]
    desc = v.description.format(o=obj.words, os=obj.plural)
    if rng.random() < 0.4:
        desc = desc[:-1] + " by " + " and ".join(CONCEPTS[k].description.lower() for k, _ in params) + "."
    return Tool(verb, obj, tuple(params), _name_of(verb, obj), desc)


@functools.cache
def pairs(split: str) -> list[tuple[str, Obj]]:
    """(verb, object) pairs of the split: "train" or "unseen"."""
    return [(v, o) for o in OBJECTS for v in o.verbs.split()
            if unseen_pair(v, o) == (split == "unseen")]


ALL_PAIRS = [(v, o) for o in OBJECTS for v in o.verbs.split()]


# ----------------------------------------------------------------------------- requests and values
def value_text(concept: Concept, value: Any) -> str:
    if concept.type == "array":
        return ", ".join(value[:-1]) + " and " + value[-1]
    return str(value)


def mention(concept: Concept, value: Any, rng: random.Random) -> str:
    if concept.type == "boolean":
        return rng.choice(concept.mentions if value else concept.false_mentions)
    return rng.choice(concept.mentions).format(v=value_text(concept, value))


def sample_values(tool: Tool, rng: random.Random) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, pname in tool.params:
        for _ in range(20):  # two parameters never carry the same value
            value = CONCEPTS[key].sample(rng)
            if value not in values.values():
                break
        values[pname] = value
    return values


def request_phrase(tool: Tool, values: dict[str, Any], rng: random.Random) -> str:
    """The request in imperative form: "create a new invoice for Anna of 250"."""
    v = VERBS[tool.verb]
    head = rng.choice(v.requests).format(o=tool.obj.words, os=tool.obj.plural)
    parts = [(key, mention(CONCEPTS[key], values[p], rng)) for key, p in tool.params]
    # an identifier reads best right after its object: "the invoice KB-3312"
    first = [m for k, m in parts if k == "code" and not m.startswith("with")]
    rest = [m for k, m in parts if not (k == "code" and not m.startswith("with"))]
    rng.shuffle(rest)
    return " ".join([head] + first + rest)


def request_text(tool: Tool, values: dict[str, Any], rng: random.Random, wrap: bool = True) -> str:
    frame = rng.choice(C.FRAMES)
    text = C.compose(frame, request_phrase(tool, values, rng))
    return C.wrap(text, rng) if wrap and rng.random() < 0.5 else text


def tool_call(tool: Tool, values: dict[str, Any]) -> dict:
    return {"type": "function", "function": {"name": tool.name, "arguments": dict(values)}}


def tool_result(tool: Tool, values: dict[str, Any], rng: random.Random) -> tuple[dict, str]:
    """What the tool returns, and the answer that reports it."""
    v = VERBS[tool.verb]
    ref = _code(rng)
    if v.past:
        return ({"status": "ok", "id": ref},
                f"Done: the {tool.obj.words} is {v.past} (reference {ref}).")
    if v.key == "count":
        n = rng.randint(0, 60)
        return {"count": n}, f"There are {n} {tool.obj.plural}."
    found = f"{C.made_up_word(rng)} {rng.choice(C.TOPICS)}"
    what = tool.obj.plural if v.plural else tool.obj.words
    return ({"status": "ok", "result": found}, f"Here is what I found for the {what}: {found}.")


def _other_tools(exclude: set[str], split: str, rng: random.Random, n: int,
                 near: tuple[str, Obj] | None = None) -> list[Tool]:
    """n tools not in `exclude`; with `near`, decoys first: the same object under other verbs,
    the same verb on other objects (words shared with the request, a different job). Training
    draws only trained pairs; an unseen request is offered trained and unseen tools alike."""
    def allowed(v: str, o: Obj) -> bool:
        return split == "unseen" or not unseen_pair(v, o)

    def add(v: str, o: Obj) -> None:
        out.append(make_tool(v, o, rng, "unseen" if unseen_pair(v, o) else "train", _rename(split)))
        exclude.add(out[-1].name)

    out: list[Tool] = []
    exclude = set(exclude)
    if near is not None:
        verb, obj = near
        same_obj = [(v, obj) for v in obj.verbs.split() if v != verb and allowed(v, obj)]
        same_verb = [(verb, o) for o in OBJECTS
                     if o is not obj and verb in o.verbs.split() and allowed(verb, o)]
        decoys = rng.sample(same_obj, min(len(same_obj), rng.randint(1, 2)))
        decoys += rng.sample(same_verb, min(len(same_verb), rng.randint(0, 1)))
        for v, o in decoys:
            if _name_of(v, o) not in exclude and len(out) < n:
                add(v, o)
    pool = ALL_PAIRS if split == "unseen" else pairs("train")
    while len(out) < n:
        v, o = rng.choice(pool)
        if _name_of(v, o) not in exclude:
            add(v, o)
    return out


def _offer(right: list[Tool], others: list[Tool], rng: random.Random) -> list[dict]:
    tools = right + others
    rng.shuffle(tools)
    return [t.schema() for t in tools]


def _pick(rng: random.Random, split: str) -> Tool:
    verb, obj = rng.choice(pairs(split))
    if split == "train" and rng.random() < MADE_UP_OBJECT:
        obj = made_up_object(obj, rng)
    return make_tool(verb, obj, rng, split, _rename(split))


def _think_call(tools: list[Tool]) -> str:
    names = " and ".join(t.name for t in tools)
    return f"The user wants this done, and {names} does it. I will call it."


# ----------------------------------------------------------------------------- documents
def tool_episode(rng: random.Random, split: str = "train", think: bool = False) -> dict:
    """A request for a generated function among decoys and others; call, result, answer; then
    maybe further rounds in the same conversation."""
    tool = _pick(rng, split)
    values = sample_values(tool, rng)
    others = _other_tools({tool.name}, split, rng, rng.randint(1, 4), near=(tool.verb, tool.obj))
    tools = _offer([tool], others, rng)
    result, answer = tool_result(tool, values, rng)
    turn: dict = {"role": "assistant", "content": "", "tool_calls": [tool_call(tool, values)]}
    if think:
        turn["reasoning_content"] = _think_call([tool])
    messages = [{"role": "user", "content": request_text(tool, values, rng)}, turn,
                {"role": "tool", "content": _json(result)}, {"role": "assistant", "content": answer}]
    offered = {t["function"]["name"] for t in tools}
    while rng.random() < 0.35:
        pool = [t for t in others if t.name in offered]
        nxt = rng.choice(pool) if pool and rng.random() < 0.6 else _pick(rng, split)
        if nxt.name not in offered:
            offered.add(nxt.name)
            tools.append(nxt.schema())
        messages += round_messages(nxt, rng)
    return {"kind": "gen_tool", "messages": messages, "tools": tools, "enable_thinking": think}


def round_messages(tool: Tool, rng: random.Random) -> list[dict]:
    """One round of an agent loop: a request for `tool`, its call, the result, the answer."""
    values = sample_values(tool, rng)
    result, answer = tool_result(tool, values, rng)
    return [{"role": "user", "content": request_text(tool, values, rng)},
            {"role": "assistant", "content": "", "tool_calls": [tool_call(tool, values)]},
            {"role": "tool", "content": _json(result)}, {"role": "assistant", "content": answer}]


def agent_tools(rng: random.Random, split: str, n: int) -> list[Tool]:
    """An agent's tool set: a function, its decoys and others (distinct names)."""
    first = _pick(rng, split)
    return [first] + _other_tools({first.name}, split, rng, n - 1, near=(first.verb, first.obj))


NO_FIT_ANSWERS = ["None of my tools can {vp}, so I can't do that here.",
                  "I can't {vp}: none of the available tools does that.",
                  "Sorry, I have no tool to {vp}."]


def no_fit_episode(rng: random.Random, split: str = "train", think: bool = False) -> dict:
    """A request for a function that is not offered; decoys share its verb or its object."""
    tool = _pick(rng, split)
    values = sample_values(tool, rng)
    others = _other_tools({tool.name}, split, rng, rng.randint(2, 5), near=(tool.verb, tool.obj))
    phrase = request_phrase(tool, values, rng)
    user = C.compose(rng.choice(C.FRAMES), phrase)
    turn = {"role": "assistant", "content": rng.choice(NO_FIT_ANSWERS).format(vp=phrase)}
    if think:
        turn["reasoning_content"] = "None of the offered tools does what the user asks. I will say so."
    return {"kind": "gen_no_fit", "tools": _offer([], others, rng), "enable_thinking": think,
            "messages": [{"role": "user", "content": user}, turn]}


def two_tool_episode(rng: random.Random, split: str = "train", think: bool = False) -> dict:
    """One request that needs two different functions: two calls in one turn."""
    first = _pick(rng, split)
    second = _pick(rng, split)
    while second.name == first.name:
        second = _pick(rng, split)
    v1, v2 = sample_values(first, rng), sample_values(second, rng)
    joiner = rng.choice([" and then ", " and also ", ", and after that "])
    user = C.compose(rng.choice(C.FRAMES), request_phrase(first, v1, rng) + joiner + request_phrase(second, v2, rng))
    others = _other_tools({first.name, second.name}, split, rng, rng.randint(0, 3), near=(first.verb, first.obj))
    r1, a1 = tool_result(first, v1, rng)
    r2, a2 = tool_result(second, v2, rng)
    turn: dict = {"role": "assistant", "content": "",
                  "tool_calls": [tool_call(first, v1), tool_call(second, v2)]}
    if think:
        turn["reasoning_content"] = _think_call([first, second])
    messages = [{"role": "user", "content": user}, turn, {"role": "tool", "content": _json(r1)},
                {"role": "tool", "content": _json(r2)}, {"role": "assistant", "content": f"{a1} {a2}"}]
    return {"kind": "gen_two", "tools": _offer([first, second], others, rng), "enable_thinking": think,
            "messages": messages}


def random_tools(rng: random.Random, split: str = "train", lo: int = 2, hi: int = 6) -> list[dict]:
    """A set of generated tools, for requests that need none."""
    return [t.schema() for t in _other_tools(set(), split, rng, rng.randint(lo, hi))]


def _json(obj: dict) -> str:
    return json.dumps(obj)
