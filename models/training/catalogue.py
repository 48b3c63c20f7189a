"""The tool catalogue and value pools the embedded model is trained on.

Every function has a fixed, descriptive name and a JSON schema in OpenAI's shape. Argument
values come from the pools below (or, for a share of training calls, from made-up strings), and
the user's words always contain them: the model must *copy* them, not invent them.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass, field

CITIES = (
    "Oslo Paris Berlin Tokyo Madrid Rome Vienna Prague Lisbon Dublin Helsinki Stockholm Warsaw "
    "Athens Cairo Nairobi Lagos Accra Dakar Tunis Casablanca Istanbul Ankara Dubai Doha Riyadh "
    "Tehran Karachi Lahore Delhi Mumbai Chennai Kolkata Dhaka Bangkok Hanoi Manila Jakarta "
    "Singapore Seoul Busan Osaka Kyoto Beijing Shanghai Shenzhen Taipei Sydney Melbourne Perth "
    "Auckland Wellington Toronto Montreal Vancouver Chicago Boston Seattle Denver Houston Dallas "
    "Miami Atlanta Phoenix Portland Austin Detroit Lima Bogota Quito Santiago Caracas Havana "
    "Reykjavik Tallinn Riga Vilnius Minsk Kyiv Budapest Bucharest Sofia Belgrade Zagreb Ljubljana "
    "Bratislava Zurich Geneva Munich Hamburg Cologne Frankfurt Milan Naples Venice Florence "
    "Barcelona Valencia Seville Porto Marseille Lyon Nice Brussels Antwerp Amsterdam Rotterdam "
    "Copenhagen Bergen Gothenburg Edinburgh Glasgow Manchester Liverpool Leeds Bristol Cardiff"
).split() + ["New York", "San Francisco", "Los Angeles", "Buenos Aires", "Mexico City",
             "Cape Town", "Hong Kong", "Kuala Lumpur", "Rio de Janeiro", "Tel Aviv"]

COUNTRIES = {
    "France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Spain": "Madrid", "Italy": "Rome",
    "Austria": "Vienna", "Portugal": "Lisbon", "Ireland": "Dublin", "Finland": "Helsinki",
    "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Ghana": "Accra", "Senegal": "Dakar", "Turkey": "Ankara",
    "Norway": "Oslo", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Peru": "Lima",
    "Colombia": "Bogota", "Ecuador": "Quito", "Chile": "Santiago", "Cuba": "Havana",
    "Iceland": "Reykjavik", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius",
    "Hungary": "Budapest", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Slovenia": "Ljubljana", "Slovakia": "Bratislava", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Denmark": "Copenhagen", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "Delhi",
    "China": "Beijing", "Korea": "Seoul", "Indonesia": "Jakarta", "Philippines": "Manila",
    "Morocco": "Rabat", "Tunisia": "Tunis", "Nigeria": "Abuja", "Qatar": "Doha",
}

TICKERS = (
    "AAPL MSFT GOOG AMZN META NVDA TSLA NFLX INTC AMD ORCL IBM CSCO ADBE CRM QCOM TXN AVGO SAP "
    "SONY UBER LYFT SHOP SNAP PYPL SQ COIN PLTR SNOW ZM DIS NKE SBUX MCD KO PEP WMT COST TGT "
    "JPM BAC WFC GS MS V MA AXP XOM CVX BP SHEL PFE MRK JNJ ABBV LLY BA GE F GM TM HMC"
).split()

CURRENCIES = (
    "USD EUR GBP JPY CHF CAD AUD NZD SEK NOK DKK PLN CZK HUF CNY HKD SGD KRW INR BRL MXN ZAR TRY "
    "AED SAR THB IDR PHP ILS"
).split()

CRYPTO = "BTC ETH SOL ADA DOT XRP DOGE LTC AVAX LINK ATOM XLM ALGO NEAR TRX".split()

NAMES = (
    "Anna Ben Carla David Emma Felix Greta Hugo Iris Jonas Karin Leo Maria Nils Olga Peter Quinn "
    "Rosa Sven Tina Umar Vera Walter Xenia Yusuf Zoe Alice Bruno Chloe Daniel Elena Farid Grace "
    "Henrik Ines Jakob Lena Marco Nora Oscar Paula Rafael Sara Tomas Ulla Victor Wanda Yara Aiko "
    "Kenji Priya Ravi Mei Chen Fatima Omar Lucia Mateo Sofia Liam Noah Mia Ella Ivan Katya"
).split()

TOPICS = (
    "budget;meeting;invoice;project plan;holiday;quarterly report;team lunch;contract;launch;"
    "interview;workshop;deadline;offsite;hiring;roadmap;release notes;design review;training;"
    "conference;birthday party;migration;security audit;customer call;sprint review"
).split(";")

SEARCH_TOPICS = (
    "solar panels;electric cars;climate change;machine learning;quantum computing;space travel;"
    "healthy recipes;marathon training;coffee brewing;bird watching;jazz history;ancient Rome;"
    "volcanoes;deep sea fish;chess openings;home gardening;rust programming;python decorators;"
    "sourdough bread;mountain biking;tea ceremonies;renewable energy;black holes;honey bees;"
    "vintage cameras;wind turbines;coral reefs;remote work;sleep science;origami"
).split(";")

NEWS_TOPICS = (
    "sports technology politics science business health music movies weather travel economy "
    "football tennis finance education energy climate space"
).split()

LANGUAGES = (
    "French German Spanish Italian Portuguese Dutch Swedish Norwegian Finnish Polish Greek "
    "Turkish Japanese Korean Chinese Hindi Arabic Russian Czech Danish"
).split()

PHRASES = (
    "good morning;thank you very much;where is the station;I love this city;see you tomorrow;"
    "the weather is nice;how much does it cost;I am hungry;happy birthday;good night;"
    "where is the library;I need a doctor;the train is late;nice to meet you;what time is it;"
    "I would like a coffee;please help me;the food is great;welcome home;have a good trip"
).split(";")

CUISINES = (
    "Italian Japanese Thai Indian Mexican Chinese Greek French Korean Vietnamese Spanish "
    "Turkish Lebanese Ethiopian Peruvian vegan seafood"
).split()

FOODS = "pizza;sushi;burger;salad;pasta;tacos;ramen;curry;sandwich;dumplings;falafel;soup".split(";")

WORDS = (
    "serendipity ephemeral ubiquitous resilient meticulous pragmatic eloquent benevolent candid "
    "diligent frugal gregarious humble intrepid jubilant lucid nostalgic obscure pensive quaint "
    "robust sublime tenacious vivid whimsical zealous ambiguous abundant fragile verbose"
).split()

UNITS = {
    "length": ["meters", "feet", "kilometers", "miles", "inches", "centimeters"],
    "mass": ["kilograms", "pounds", "grams", "ounces"],
    "volume": ["liters", "gallons", "milliliters", "cups"],
}
ALL_UNITS = [u for group in UNITS.values() for u in group]

AIRLINES = "LH BA AF KL DL UA AA SK AY IB QR EK TK NH JL".split()
WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()

_SYLLABLES = ("ka ri to mo zu va le ni ro sa qu ex yl th or an bel dr gr ix om ul ve"
              " za pe fi lo".split())


def made_up_word(rng: random.Random) -> str:
    """A pronounceable string the model never saw as a pool value (e.g. 'Zuvaleth')."""
    word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
    return word.capitalize()


@dataclass
class Param:
    name: str
    type: str  # JSON schema type: string, integer, number
    description: str
    sample: str  # key into SAMPLERS
    enum: list[str] | None = None


@dataclass
class Function:
    name: str
    description: str
    params: list[Param]
    # user phrasings; {param} placeholders; the last HOLDOUT_PHRASINGS are never trained on
    phrasings: list[str]
    # final answer after the tool result, placeholders from args and result
    answer: str
    required: list[str] = field(default_factory=list)

    def schema(self) -> dict:
        props = {}
        for p in self.params:
            prop = {"type": p.type, "description": p.description}
            if p.enum:
                prop["enum"] = list(p.enum)
            props[p.name] = prop
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": self.required or [p.name for p in self.params],
                },
            },
        }


HOLDOUT_PHRASINGS = 2


def _p(name, type_, desc, sample, enum=None):
    return Param(name, type_, desc, sample, enum)


FUNCTIONS: list[Function] = [
    Function("get_weather", "Get the current weather for a city.",
             [_p("city", "string", "Name of the city", "city")],
             ["What's the weather in {city}?", "How is the weather in {city} today?",
              "Is it raining in {city}?", "Weather for {city}, please.",
              "Tell me the weather in {city}.", "What is it like outside in {city} right now?",
              "Check the weather in {city} for me.", "Do I need an umbrella in {city}?",
              "How warm is it in {city}?", "Give me the current conditions in {city}."],
             "It is {temperature_c} degrees and {condition} in {city}."),
    Function("get_current_time", "Get the current local time in a city.",
             [_p("city", "string", "Name of the city", "city")],
             ["What time is it in {city}?", "Tell me the local time in {city}.",
              "What's the time in {city} right now?", "Current time in {city}?",
              "Can you check the clock in {city}?", "Is it late in {city} now?",
              "Which hour is it in {city}?", "Look up the time in {city}."],
             "It is {time} in {city} right now."),
    Function("get_stock_price", "Get the latest stock price for a ticker symbol.",
             [_p("ticker", "string", "Stock ticker symbol, e.g. AAPL", "ticker")],
             ["What is the stock price of {ticker}?", "How is {ticker} trading today?",
              "Get me the latest price for {ticker}.", "Quote for {ticker}, please.",
              "Check {ticker} stock for me.", "What's {ticker} at right now?",
              "How much is one share of {ticker}?", "Show the share price of {ticker}."],
             "{ticker} is trading at {price} USD."),
    Function("convert_currency", "Convert an amount of money from one currency to another.",
             [_p("amount", "number", "Amount to convert", "amount"),
              _p("from_currency", "string", "ISO code of the source currency", "currency"),
              _p("to_currency", "string", "ISO code of the target currency", "currency2")],
             ["Convert {amount} {from_currency} to {to_currency}.",
              "How much is {amount} {from_currency} in {to_currency}?",
              "What are {amount} {from_currency} worth in {to_currency}?",
              "Change {amount} {from_currency} into {to_currency}, please.",
              "I have {amount} {from_currency}. How many {to_currency} is that?",
              "Exchange {amount} {from_currency} for {to_currency}.",
              "{amount} {from_currency} to {to_currency}?",
              "Please convert {amount} from {from_currency} to {to_currency}."],
             "{amount} {from_currency} is {converted} {to_currency}."),
    Function("send_email", "Send an email to a contact.",
             [_p("recipient", "string", "Name of the contact", "name"),
              _p("subject", "string", "Subject line of the email", "topic")],
             ["Send an email to {recipient} about the {subject}.",
              "Email {recipient} about the {subject}.",
              "Write {recipient} an email with the subject {subject}.",
              "Please mail {recipient} regarding the {subject}.",
              "Drop {recipient} an email about the {subject}.",
              "Can you email {recipient}? The subject is {subject}.",
              "Notify {recipient} by email about the {subject}.",
              "Shoot an email to {recipient} on the {subject}."],
             "Done: I sent the email about the {subject} to {recipient}."),
    Function("search_web", "Search the web and return the top results.",
             [_p("query", "string", "The search query", "search")],
             ["Search the web for {query}.", "Look up {query} online.",
              "Find me articles about {query}.", "Can you google {query}?",
              "I want to read about {query}. Search for it.", "Search for {query}, please.",
              "Do a web search on {query}.", "Find information on {query}."],
             "The top result for {query} is: {title}."),
    Function("set_timer", "Start a countdown timer.",
             [_p("minutes", "integer", "Duration in minutes", "minutes")],
             ["Set a timer for {minutes} minutes.", "Start a {minutes} minute timer.",
              "Timer for {minutes} minutes, please.", "Count down {minutes} minutes for me.",
              "Remind me in {minutes} minutes with a timer.", "Put a timer on for {minutes} minutes.",
              "Can you time {minutes} minutes?", "I need a {minutes} minute countdown."],
             "Your timer for {minutes} minutes is running."),
    Function("translate_text", "Translate text into another language.",
             [_p("text", "string", "The text to translate", "phrase"),
              _p("target_language", "string", "Language to translate into", "language")],
             ["Translate \"{text}\" into {target_language}.",
              "How do you say \"{text}\" in {target_language}?",
              "Please translate \"{text}\" to {target_language}.",
              "What is \"{text}\" in {target_language}?",
              "Say \"{text}\" in {target_language}.",
              "Can you put \"{text}\" into {target_language}?",
              "I need \"{text}\" in {target_language}.",
              "Render \"{text}\" in {target_language}, please."],
             "In {target_language}, \"{text}\" is \"{translation}\"."),
    Function("create_calendar_event", "Create an event in the user's calendar.",
             [_p("title", "string", "Title of the event", "topic"),
              _p("day", "string", "Day of the week", "weekday")],
             ["Add a {title} to my calendar on {day}.", "Schedule the {title} for {day}.",
              "Put the {title} in my calendar on {day}.", "Create an event called {title} on {day}.",
              "Book the {title} on {day} in my calendar.", "I have the {title} on {day}. Add it.",
              "Block {day} for the {title}.", "Calendar: {title} on {day}, please."],
             "I added the {title} to your calendar on {day}."),
    Function("get_news", "Get the latest news headlines on a topic.",
             [_p("topic", "string", "News topic", "news")],
             ["What's new in {topic}?", "Give me the latest {topic} news.",
              "Any {topic} headlines today?", "Show me news about {topic}.",
              "What happened in {topic} today?", "Top {topic} stories, please.",
              "Catch me up on {topic} news.", "Brief me on the {topic} headlines."],
             "Top {topic} headline: {headline}."),
    Function("book_flight", "Book a flight between two cities.",
             [_p("origin", "string", "Departure city", "city"),
              _p("destination", "string", "Arrival city", "city2")],
             ["Book a flight from {origin} to {destination}.",
              "I need to fly from {origin} to {destination}.",
              "Get me a plane ticket from {origin} to {destination}.",
              "Find and book a flight {origin} to {destination}.",
              "Reserve a flight leaving {origin} for {destination}.",
              "Fly me from {origin} to {destination}, please.",
              "Can you book {origin} to {destination} for me?",
              "I want a flight to {destination} from {origin}."],
             "Your flight from {origin} to {destination} is booked, reference {reference}."),
    Function("get_directions", "Get driving directions between two places.",
             [_p("origin", "string", "Starting point", "city"),
              _p("destination", "string", "Destination", "city2")],
             ["How do I get from {origin} to {destination}?",
              "Directions from {origin} to {destination}, please.",
              "Route me from {origin} to {destination}.",
              "Show the way from {origin} to {destination}.",
              "What's the best route from {origin} to {destination}?",
              "Navigate from {origin} to {destination}.",
              "How far is it to drive from {origin} to {destination}?",
              "I am driving to {destination} from {origin}. Which way?"],
             "From {origin} to {destination} is {distance_km} km, about {hours} hours by car."),
    Function("play_music", "Play music by an artist.",
             [_p("artist", "string", "Name of the artist", "name")],
             ["Play some music by {artist}.", "Put on {artist}.", "I want to hear {artist}.",
              "Play songs from {artist}.", "Start a playlist of {artist}.",
              "Can you play {artist} for me?", "Queue up {artist}.", "Some {artist}, please."],
             "Now playing music by {artist}."),
    Function("set_reminder", "Set a reminder at a given hour.",
             [_p("task", "string", "What to be reminded of", "topic"),
              _p("hour", "integer", "Hour of the day, 0-23", "hour")],
             ["Remind me about the {task} at {hour} o'clock.",
              "Set a reminder for the {task} at {hour}.",
              "At {hour} remind me of the {task}.",
              "Don't let me forget the {task} at {hour} o'clock.",
              "I need a reminder at {hour} for the {task}.",
              "Ping me at {hour} about the {task}.",
              "Reminder: {task} at {hour} o'clock.",
              "Please remind me at {hour} about the {task}."],
             "I will remind you about the {task} at {hour} o'clock."),
    Function("calculate", "Evaluate an arithmetic expression.",
             [_p("expression", "string", "Arithmetic expression", "expression")],
             ["Calculate {expression}.", "What is {expression}?", "Compute {expression}.",
              "Work out {expression} for me.", "How much is {expression}?",
              "Evaluate {expression}.", "Solve {expression}.", "Can you calculate {expression}?"],
             "{expression} = {result}."),
    Function("get_exchange_rate", "Get the exchange rate between two currencies.",
             [_p("base", "string", "Base currency code", "currency"),
              _p("quote", "string", "Quote currency code", "currency2")],
             ["What is the exchange rate from {base} to {quote}?",
              "{base} to {quote} rate?", "How many {quote} per {base} today?",
              "Show the {base}/{quote} rate.", "Current rate between {base} and {quote}?",
              "Check the {base} {quote} exchange rate.", "Rate of {base} in {quote}, please.",
              "How strong is {base} against {quote}?"],
             "One {base} buys {rate} {quote}."),
    Function("find_restaurant", "Find a restaurant in a city by cuisine.",
             [_p("city", "string", "City to search in", "city"),
              _p("cuisine", "string", "Type of food", "cuisine")],
             ["Find a {cuisine} restaurant in {city}.", "Where can I eat {cuisine} food in {city}?",
              "Recommend a {cuisine} place in {city}.", "Any good {cuisine} restaurants in {city}?",
              "I want {cuisine} food in {city}. Find a place.",
              "Search for {cuisine} dining in {city}.", "Best {cuisine} spot in {city}?",
              "Look for a {cuisine} restaurant near {city}."],
             "Try {restaurant}, a {cuisine} restaurant in {city}."),
    Function("get_population", "Get the population of a country.",
             [_p("country", "string", "Name of the country", "country")],
             ["What is the population of {country}?", "How many people live in {country}?",
              "Population of {country}?", "How big is the population of {country}?",
              "Tell me how many people {country} has.", "Look up the population of {country}.",
              "How populous is {country}?", "Give me the number of inhabitants of {country}."],
             "{country} has about {population} million people."),
    Function("check_flight_status", "Check the status of a flight by its number.",
             [_p("flight_number", "string", "Flight number such as LH452", "flight")],
             ["What is the status of flight {flight_number}?", "Is {flight_number} on time?",
              "Check flight {flight_number} for me.", "Has {flight_number} landed?",
              "Track flight {flight_number}.", "Is flight {flight_number} delayed?",
              "Where is flight {flight_number} now?", "Status of {flight_number}, please."],
             "Flight {flight_number} is {status}."),
    Function("order_food", "Order food for delivery.",
             [_p("item", "string", "Dish to order", "food"),
              _p("quantity", "integer", "How many portions", "quantity")],
             ["Order {quantity} {item} for delivery.", "I want {quantity} {item}, please order.",
              "Get me {quantity} portions of {item}.", "Can you order {quantity} {item}?",
              "Deliver {quantity} {item} to my place.", "Please order {item}, {quantity} of them.",
              "We need {quantity} {item} delivered.", "Place an order for {quantity} {item}."],
             "I ordered {quantity} {item} for you."),
    Function("define_word", "Look up the dictionary definition of a word.",
             [_p("word", "string", "The word to define", "word")],
             ["What does {word} mean?", "Define {word}.", "Give me the meaning of {word}.",
              "Look up {word} in the dictionary.", "What is the definition of {word}?",
              "Explain the word {word}.", "Meaning of {word}?", "I don't know the word {word}."],
             "{word}: {definition}."),
    Function("get_crypto_price", "Get the current price of a cryptocurrency.",
             [_p("symbol", "string", "Crypto symbol such as BTC", "crypto")],
             ["What is the price of {symbol}?", "How much is {symbol} worth now?",
              "Check the {symbol} price.", "Current {symbol} value?", "Quote {symbol} for me.",
              "Where is {symbol} trading?", "Price of one {symbol}, please.",
              "Is {symbol} up today?"],
             "One {symbol} costs {price} USD."),
    Function("convert_units", "Convert a measurement between units.",
             [_p("value", "number", "The value to convert", "amount"),
              _p("from_unit", "string", "Unit to convert from", "unit", ALL_UNITS),
              _p("to_unit", "string", "Unit to convert to", "unit2", ALL_UNITS)],
             ["Convert {value} {from_unit} to {to_unit}.", "How many {to_unit} is {value} {from_unit}?",
              "What is {value} {from_unit} in {to_unit}?", "{value} {from_unit} in {to_unit}?",
              "Change {value} {from_unit} into {to_unit}.", "Express {value} {from_unit} in {to_unit}.",
              "Turn {value} {from_unit} into {to_unit}, please.",
              "I have {value} {from_unit}. How much is that in {to_unit}?"],
             "{value} {from_unit} is {converted} {to_unit}."),
    Function("get_air_quality", "Get the air quality index for a city.",
             [_p("city", "string", "Name of the city", "city")],
             ["What is the air quality in {city}?", "Is the air clean in {city} today?",
              "Air quality index for {city}?", "How polluted is {city} right now?",
              "Check the smog level in {city}.", "Can I go running in {city}, how is the air?",
              "Show the AQI for {city}.", "Is it safe to breathe in {city} today?"],
             "The air quality index in {city} is {aqi}, which is {level}."),
]

FUNCTIONS_BY_NAME = {f.name: f for f in FUNCTIONS}


def _number(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.5:
        return str(rng.randint(2, 999))
    if roll < 0.8:
        return str(rng.randint(1000, 99999))
    return f"{rng.randint(1, 999)}.{rng.randint(1, 99)}"


def _expression(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    return f"{a} {rng.choice('+-*/')} {b}"


def _flight(rng: random.Random) -> str:
    return f"{rng.choice(AIRLINES)}{rng.randint(10, 9999)}"


POOLS = {
    "city": CITIES, "city2": CITIES, "ticker": TICKERS, "currency": CURRENCIES,
    "currency2": CURRENCIES, "name": NAMES, "topic": TOPICS, "search": SEARCH_TOPICS,
    "news": NEWS_TOPICS, "language": LANGUAGES, "phrase": PHRASES, "weekday": WEEKDAYS,
    "cuisine": CUISINES, "country": list(COUNTRIES), "food": FOODS, "word": WORDS,
    "crypto": CRYPTO, "unit": ALL_UNITS, "unit2": ALL_UNITS,
}
GENERATED = {
    "amount": _number, "minutes": lambda r: str(r.randint(1, 180)),
    "hour": lambda r: str(r.randint(0, 23)), "expression": _expression, "flight": _flight,
    "quantity": lambda r: str(r.randint(1, 12)),
}
# Samplers whose values may be swapped for a made-up word during training (free-text names).
MADE_UP_OK = {"city", "city2", "name", "country", "cuisine", "word", "food"}


# ----------------------------------------------------------------------------- composed phrasings
# Besides its whole-sentence phrasings, every function has requests in imperative form ("check
# the weather in {city}"), and shared frames turn one into a sentence ("Could you {vp}, please?").
# A frame x request combination is held out by hash (about 1 in 5): every word of a held-out
# prompt is known, but the model never saw the sentence. That is how new phrasings of the same
# need look to a model this small; whole sentences with words it never saw stay a separate,
# harder measure (the last HOLDOUT_PHRASINGS of each function).
REQUESTS: dict[str, list[str]] = {
    "get_weather": ["check the weather in {city}", "get the weather for {city}",
                    "look up the weather in {city}", "tell me the weather in {city}",
                    "find the current weather in {city}", "report the weather for {city}"],
    "get_current_time": ["check the time in {city}", "get the local time in {city}",
                         "tell me the time in {city}", "look up the current time in {city}",
                         "find out what time it is in {city}"],
    "get_stock_price": ["check the stock price of {ticker}", "get the share price for {ticker}",
                        "look up {ticker} stock", "tell me the price of {ticker} stock",
                        "find the latest quote for {ticker}"],
    "convert_currency": ["convert {amount} {from_currency} to {to_currency}",
                         "change {amount} {from_currency} into {to_currency}",
                         "turn {amount} {from_currency} into {to_currency}",
                         "work out {amount} {from_currency} in {to_currency}",
                         "calculate {amount} {from_currency} in {to_currency}"],
    "send_email": ["send an email to {recipient} about the {subject}",
                   "email {recipient} about the {subject}",
                   "write an email to {recipient} about the {subject}",
                   "mail {recipient} about the {subject}",
                   "send {recipient} an email on the {subject}"],
    "search_web": ["search the web for {query}", "look up {query} online",
                   "find web pages about {query}", "search online for {query}",
                   "run a web search on {query}"],
    "set_timer": ["set a timer for {minutes} minutes", "start a {minutes} minute timer",
                  "start a timer of {minutes} minutes", "count down {minutes} minutes",
                  "put on a timer for {minutes} minutes"],
    "translate_text": ["translate \"{text}\" into {target_language}",
                       "translate \"{text}\" to {target_language}",
                       "say \"{text}\" in {target_language}",
                       "put \"{text}\" into {target_language}",
                       "give me \"{text}\" in {target_language}"],
    "create_calendar_event": ["add a {title} to my calendar on {day}",
                              "put a {title} in my calendar on {day}",
                              "schedule a {title} on {day}",
                              "create a calendar event {title} on {day}",
                              "book a {title} in my calendar for {day}"],
    "get_news": ["get the latest {topic} news", "show me the news about {topic}",
                 "find the news on {topic}", "tell me the {topic} headlines",
                 "check the {topic} news"],
    "book_flight": ["book a flight from {origin} to {destination}",
                    "get me a flight from {origin} to {destination}",
                    "reserve a flight from {origin} to {destination}",
                    "find and book a flight from {origin} to {destination}",
                    "buy a plane ticket from {origin} to {destination}"],
    "get_directions": ["give me directions from {origin} to {destination}",
                       "find the route from {origin} to {destination}",
                       "get directions from {origin} to {destination}",
                       "show me the way from {origin} to {destination}",
                       "plan the route from {origin} to {destination}"],
    "play_music": ["play some music by {artist}", "play songs by {artist}",
                   "put on music by {artist}", "start playing {artist}",
                   "play a song from {artist}"],
    "set_reminder": ["remind me about the {task} at {hour} o'clock",
                     "set a reminder for the {task} at {hour} o'clock",
                     "create a reminder about the {task} at {hour} o'clock",
                     "add a reminder for the {task} at {hour} o'clock",
                     "remind me of the {task} at {hour} o'clock"],
    "calculate": ["calculate {expression}", "compute {expression}", "work out {expression}",
                  "evaluate {expression}", "do the math for {expression}"],
    "get_exchange_rate": ["get the exchange rate from {base} to {quote}",
                          "check the rate of {base} to {quote}",
                          "look up the {base} to {quote} exchange rate",
                          "tell me the exchange rate from {base} to {quote}",
                          "find the current rate from {base} to {quote}"],
    "find_restaurant": ["find a {cuisine} restaurant in {city}",
                        "look for a {cuisine} restaurant in {city}",
                        "recommend a {cuisine} restaurant in {city}",
                        "search for {cuisine} food in {city}",
                        "pick a {cuisine} place to eat in {city}"],
    "get_population": ["get the population of {country}", "look up the population of {country}",
                       "tell me the population of {country}",
                       "find out how many people live in {country}",
                       "check the population of {country}"],
    "check_flight_status": ["check the status of flight {flight_number}",
                            "track flight {flight_number}",
                            "look up flight {flight_number}",
                            "tell me the status of flight {flight_number}",
                            "find out if flight {flight_number} is on time"],
    "order_food": ["order {quantity} {item} for delivery", "get me {quantity} {item} delivered",
                   "place an order for {quantity} {item}", "order {quantity} {item} to my door",
                   "buy {quantity} {item} for delivery"],
    "define_word": ["define the word {word}", "look up the meaning of {word}",
                    "tell me what {word} means", "explain the word {word}",
                    "give me the definition of {word}"],
    "get_crypto_price": ["check the price of {symbol}", "get the current {symbol} price",
                         "look up {symbol} in the crypto market",
                         "tell me what {symbol} is worth", "find the latest {symbol} price"],
    "convert_units": ["convert {value} {from_unit} to {to_unit}",
                      "change {value} {from_unit} into {to_unit}",
                      "express {value} {from_unit} in {to_unit}",
                      "turn {value} {from_unit} into {to_unit}",
                      "work out {value} {from_unit} in {to_unit}"],
    "get_air_quality": ["check the air quality in {city}", "get the air quality for {city}",
                        "look up the pollution level in {city}",
                        "tell me how clean the air is in {city}",
                        "find the air quality index of {city}"],
}

# frames around a request; "{vp}" is the request, "{Vp}" the same with a capital first letter
FRAMES = ["{Vp}.", "Please {vp}.", "Can you {vp}?", "Could you {vp}, please?",
          "I need you to {vp}.", "Would you {vp} for me?", "I'd like you to {vp}.",
          "Go ahead and {vp}.", "Help me out and {vp}.", "Hey, {vp}.", "Can you please {vp}?",
          "{Vp}, thanks.", "Quick favour: {vp}.", "Right now, {vp}.", "Please, {vp} now.",
          "I want you to {vp}."]

# shared openers and closers that wrap any request (whole or composed)
OPENERS = ["", "", "", "Hi! ", "Hello. ", "Hey there. ", "Good morning. ", "Okay. ", "So, ",
           "One more thing. ", "Quick question. ", "Sorry to bother you. ", "I have a request. "]
CLOSERS = ["", "", "", " Thanks!", " Thank you.", " Cheers.", " It's urgent.",
           " I need it for work.", " Much appreciated.", " No rush."]


def composed_heldout(function: str, frame: int, request: int) -> bool:
    digest = hashlib.sha256(f"{function}|{frame}|{request}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 5 == 0


def compose(frame: str, request: str) -> str:
    return frame.replace("{Vp}", request[0].upper() + request[1:]).replace("{vp}", request)


@functools.cache
def composed_phrasings(function: str, split: str) -> list[str]:
    """Frame x request sentences of `function` in `split` ("train" or "heldout")."""
    whole = next(f.phrasings for f in FUNCTIONS if f.name == function)
    out = []
    for i, frame in enumerate(FRAMES):
        for j, request in enumerate(REQUESTS[function]):
            if composed_heldout(function, i, j) == (split == "heldout"):
                out.append(compose(frame, request))
    # a combination that happens to equal a whole trained sentence is not new
    return [s for s in out if split == "train" or s not in whole]


def wrap(sentence: str, rng: random.Random) -> str:
    """An opener and a closer around a request, as people write them."""
    opener, closer = rng.choice(OPENERS), rng.choice(CLOSERS)
    if opener and rng.random() < 0.3:
        opener = opener.rstrip(". !,") + ", "
    if opener.endswith(", ") and not sentence.startswith(("I ", "I'")):
        sentence = sentence[0].lower() + sentence[1:]
    return f"{opener}{sentence}{closer}"
