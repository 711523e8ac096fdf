"""``sql``: questions about a small shop's orders, answered with a read-only SQL tool over a DuckDB table.

The table (``data/sql/orders.csv``, 180 orders of 2023 and 2024) and the questions
(``data/sql/questions.jsonl``) are generated, not downloaded: :func:`generate_orders` draws the orders
from a fixed seed and :func:`generate_questions` fills question templates from the table, computing
each answer by running its ground-truth SQL against the table (stored with the question, so a test
can re-check every answer). ``python -m evertrain.envs.sql`` rewrites both files; a test checks that
doing so reproduces the vendored files byte for byte.

Each question's split is fixed by content (a hash of its text), so train and eval never share a
question. Answers are numbers (graded by the strict rule) or, for "which ..." questions, a name from
the table, graded by exact match after normalization (:func:`normalize_text`). Questions whose
answer would be a tie are never generated.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import io
import json
import random
from decimal import ROUND_HALF_UP, Decimal
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from evertrain.envs.answers import extract_final_answer, grade_math, parse_number, question_and_answer
from evertrain.envs.base import FixedSplits, Problem, Split, Tool, Verdict, vendored_path
from evertrain.envs.tools import Message, SqlTable, SqlTool, ToolCall, ToolEnvironment

ORDERS = SqlTable(
    name="orders",
    csv=("sql", "orders.csv"),
    columns=(("order_id", "INTEGER"), ("order_date", "DATE"), ("customer", "VARCHAR"), ("country", "VARCHAR"),
             ("product", "VARCHAR"), ("category", "VARCHAR"), ("quantity", "INTEGER"),
             ("unit_price", "DECIMAL(8,2)")),
)

# ---------------------------------------------------------------------------------------------------
# The generated table

SEED = 20240601
N_ORDERS = 180
CUSTOMERS = (  # name, country: fictional small businesses
    ("Alder Bakery", "Canada"), ("Birch Cafe", "Canada"), ("Cobalt Studio", "Germany"),
    ("Delta Garage", "Mexico"), ("Ember Books", "France"), ("Fjord Outfitters", "Germany"),
    ("Granite Works", "Australia"), ("Harbor Florist", "Australia"), ("Iris Dental", "France"),
    ("Juniper School", "Kenya"), ("Kestrel Print", "Japan"), ("Lumen Lab", "Japan"),
    ("Maple Daycare", "Canada"), ("Nimbus Travel", "Brazil"), ("Orchid Spa", "Brazil"),
    ("Pine Hardware", "Mexico"), ("Quartz Clinic", "Kenya"), ("Ridge Brewery", "Germany"),
    ("Saffron Kitchen", "France"), ("Tidal Surf Shop", "Australia"),
)
PRODUCTS = (  # name, category, 2023 unit price (2024 prices are 8% higher, rounded to the cent)
    ("Stapler", "Office", "12.50"), ("Notebook", "Office", "3.20"), ("Desk Lamp", "Office", "34.90"),
    ("Kettle", "Kitchen", "29.99"), ("Chef Knife", "Kitchen", "45.00"), ("Cutting Board", "Kitchen", "18.75"),
    ("Watering Can", "Garden", "15.40"), ("Pruning Shears", "Garden", "22.10"), ("Seed Pack", "Garden", "2.35"),
    ("USB Cable", "Electronics", "7.99"), ("Headphones", "Electronics", "59.00"),
    ("Power Bank", "Electronics", "39.50"),
)
QUANTITIES = (1, 1, 2, 2, 2, 3, 3, 4, 5, 6, 8, 10, 12, 15, 20)
YEARS = (2023, 2024)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def _price(base: str, year: int) -> Decimal:
    price = Decimal(base)
    if year == 2024:
        price = (price * Decimal("1.08")).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    return price


def generate_orders() -> str:
    """The CSV text of the orders table, the same on every run (a fixed seed, Python's Mersenne Twister)."""
    rng = random.Random(SEED)
    start = dt.date(2023, 1, 1)
    customer_weights = [rng.randint(1, 6) for _ in CUSTOMERS]
    product_weights = [rng.randint(1, 5) for _ in PRODUCTS]
    drawn = []
    for _ in range(N_ORDERS):
        day = start + dt.timedelta(days=rng.randrange(731))  # 2023 and 2024 (a leap year)
        customer, country = rng.choices(CUSTOMERS, customer_weights)[0]
        product, category, base = rng.choices(PRODUCTS, product_weights)[0]
        drawn.append((day, customer, country, product, category, rng.choice(QUANTITIES), _price(base, day.year)))
    drawn.sort(key=lambda row: row[0])  # stable: same-day orders keep their drawing order
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([name for name, _ in ORDERS.columns])
    for number, (day, customer, country, product, category, quantity, price) in enumerate(drawn, 1):
        writer.writerow([number, day.isoformat(), customer, country, product, category, quantity, f"{price:.2f}"])
    return out.getvalue()


# ---------------------------------------------------------------------------------------------------
# The generated questions


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _templates() -> list[tuple[str, str, str]]:
    """(template, question, ground-truth SQL) for every question the templates make."""
    countries = sorted({country for _, country in CUSTOMERS})
    categories = sorted({category for _, category, _ in PRODUCTS})
    out: list[tuple[str, str, str]] = []
    for customer, _ in CUSTOMERS:
        for year in YEARS:
            out.append(("orders_by_customer_year", f"How many orders did {customer} place in {year}?",
                        f"SELECT count(*) AS orders FROM orders WHERE customer = {_quote(customer)} "
                        f"AND year(order_date) = {year}"))
    for product, _, _ in PRODUCTS:
        out.append(("units_of_product", f"How many units of {product} were sold in total?",
                    f"SELECT coalesce(sum(quantity), 0) AS units FROM orders WHERE product = {_quote(product)}"))
        out.append(("customers_of_product", f"How many different customers ordered {product}?",
                    f"SELECT count(DISTINCT customer) AS customers FROM orders WHERE product = {_quote(product)}"))
        out.append(("largest_order_of_product",
                    f"What is the largest quantity of {product} bought in a single order?",
                    f"SELECT max(quantity) AS largest FROM orders WHERE product = {_quote(product)}"))
        for year in YEARS:
            out.append(("revenue_of_product_year",
                        f"What was the total revenue (quantity times unit price) from {product} in {year}?",
                        f"SELECT coalesce(sum(quantity * unit_price), 0) AS revenue FROM orders "
                        f"WHERE product = {_quote(product)} AND year(order_date) = {year}"))
    for country in countries:
        for year in YEARS:
            out.append(("revenue_of_country_year",
                        f"What was the total revenue (quantity times unit price) from customers in {country} "
                        f"in {year}?",
                        f"SELECT coalesce(sum(quantity * unit_price), 0) AS revenue FROM orders "
                        f"WHERE country = {_quote(country)} AND year(order_date) = {year}"))
        for category in categories:
            out.append(("units_of_category_country",
                        f"How many units of {category} products did customers in {country} buy?",
                        f"SELECT coalesce(sum(quantity), 0) AS units FROM orders "
                        f"WHERE category = {_quote(category)} AND country = {_quote(country)}"))
        out.append(("top_product_of_country",
                    f"Which product sold the most units to customers in {country}?",
                    f"SELECT product, sum(quantity) AS units FROM orders WHERE country = {_quote(country)} "
                    f"GROUP BY product ORDER BY units DESC, product LIMIT 2"))
    for year in YEARS:
        for month, name in enumerate(MONTHS, 1):
            out.append(("orders_in_month", f"How many orders were placed in {name} {year}?",
                        f"SELECT count(*) AS orders FROM orders "
                        f"WHERE year(order_date) = {year} AND month(order_date) = {month}"))
        for threshold in (10, 15):
            out.append(("large_orders_in_year",
                        f"How many orders in {year} were for at least {threshold} units?",
                        f"SELECT count(*) AS orders FROM orders "
                        f"WHERE year(order_date) = {year} AND quantity >= {threshold}"))
        out.append(("top_customer_of_year", f"Which customer placed the most orders in {year}?",
                    f"SELECT customer, count(*) AS orders FROM orders WHERE year(order_date) = {year} "
                    f"GROUP BY customer ORDER BY orders DESC, customer LIMIT 2"))
    for category in categories:
        out.append(("top_spender_of_category",
                    f"Which customer spent the most in total on {category} products?",
                    f"SELECT customer, sum(quantity * unit_price) AS spent FROM orders "
                    f"WHERE category = {_quote(category)} GROUP BY customer ORDER BY spent DESC, customer LIMIT 2"))
    return out


def _split_of(question: str) -> Split:
    """A fifth of the questions are held out, chosen by a hash of the text (not by file order)."""
    return "eval" if int(hashlib.sha256(question.encode()).hexdigest(), 16) % 5 == 0 else "train"


def generate_questions(tool: SqlTool | None = None) -> str:
    """The JSONL text of the questions: each answer is the result of its SQL over the vendored table.

    A "which ..." question's SQL returns its top two rows; the question is kept only when the first
    strictly beats the second (no ties), and its answer is the first row's name.
    """
    con = (tool or SqlTool(ORDERS)).connect()
    lines = []
    try:
        for template, question, sql in _templates():
            rows = con.execute(sql).fetchall()
            if template.startswith("top_"):
                if not rows or (len(rows) > 1 and rows[0][1] == rows[1][1]):
                    continue
                answer, answer_type = str(rows[0][0]), "text"
            else:
                answer, answer_type = str(rows[0][0]), "number"
            record = {"question": question, "answer": answer, "answer_type": answer_type, "sql": sql,
                      "template": template, "split": _split_of(question)}
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        con.close()
    return "".join(lines)


def write_data(folder: Path) -> None:
    """Write orders.csv, then questions.jsonl computed from it, into ``folder`` (data/sql)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "orders.csv").write_text(generate_orders())
    # the questions read the table just written
    (folder / "questions.jsonl").write_text(generate_questions(SqlTool(ORDERS, csv_path=folder / "orders.csv")))


# ---------------------------------------------------------------------------------------------------
# The environment


def normalize_text(text: str) -> str:
    """A name answer as compared: surrounding quotes, backticks, ``**`` and a final period dropped,
    case folded, whitespace collapsed. Nothing else is forgiven (a list of names is wrong)."""
    value = " ".join(text.split())
    for _ in range(3):
        value = value.strip().removesuffix(".").strip()
        for pair in ("**", "`", '"', "'"):
            if len(value) >= 2 * len(pair) and value.startswith(pair) and value.endswith(pair):
                value = value[len(pair):-len(pair)]
    return value.strip().casefold()


def grade_text(completion: str, expected: str) -> Verdict:
    """Grade a name answer: exactly one final answer (the strict rule's markers), equal after normalization."""
    answer, reason = extract_final_answer(completion)
    if answer is None:
        return Verdict.fail(reason)
    if not normalize_text(answer) or normalize_text(answer) != normalize_text(expected):
        return Verdict.fail("wrong_answer", answer=answer[:200], expected=expected)
    return Verdict.ok(answer=answer[:200])


_TOOL = SqlTool(ORDERS)


class SqlQuestions(FixedSplits, ToolEnvironment):
    """Questions about the shop's orders; the policy may query the table with the ``sql`` tool."""

    name: ClassVar[str] = "sql"
    source: ClassVar[str] = "data/sql/questions.jsonl (generated from data/sql/orders.csv, see its README)"
    templated: ClassVar[bool] = True
    tools: ClassVar[dict[str, Tool]] = {"sql": _TOOL}
    max_turns: ClassVar[int] = 4
    system_prompt: ClassVar[str] = (
        "Answer the question about a shop's orders. The DuckDB table `orders` has one row per order, with "
        "columns order_id INTEGER, order_date DATE (2023 and 2024), customer VARCHAR, country VARCHAR, "
        "product VARCHAR, category VARCHAR, quantity INTEGER, unit_price DECIMAL(8,2).\n"
        "To look at the table, write one read-only SQL query between <sql> and </sql> and stop; its result "
        "comes back in the next message. You may query up to 3 times.\n"
        "When you know the answer, do not write a query: give the final answer on the last line as "
        "'#### <answer>', a number or a name exactly as it appears in the table."
    )
    worked_example: ClassVar[tuple[Message, ...]] = (
        {"role": "user", "content": "How many orders came from customers in Kenya?"},
        {"role": "assistant",
         "content": "I will count the orders whose country is Kenya.\n<sql>\n"
                    "SELECT count(*) AS orders FROM orders WHERE country = 'Kenya'\n</sql>"},
        {"role": "tool", "content": "orders\n11\n(1 row)"},
        {"role": "assistant", "content": "11 orders came from customers in Kenya.\n#### 11"},
    )

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        path = vendored_path("sql", "questions.jsonl")
        splits: dict[str, list[Problem]] = {"train": [], "eval": []}
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                    question, split = row["question"], row["split"]
                    payload = {"answer": row["answer"], "answer_type": row["answer_type"], "sql": row["sql"],
                               "template": row["template"]}
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise ValueError(f"{path}:{number}: not a question row ({error!r})") from None
                if split not in splits:
                    raise ValueError(f"{path}:{number}: unknown split {split!r}")
                splits[split].append(Problem.make(self.name, question, payload, split))
        return splits

    def grade_answer(self, problem: Problem, text: str) -> Verdict:
        if problem.payload.get("answer_type") == "text":
            return grade_text(text, problem.payload["answer"])
        return grade_math(text, problem.payload["answer"])

    def reference_calls(self, problem: Problem) -> list[ToolCall]:
        sql = problem.payload.get("sql")
        return [ToolCall("sql", sql)] if sql else []

    def reference(self, problem: Problem) -> str | None:
        answer = problem.payload["answer"]
        return f"The query gives the answer: {answer}.\n#### {answer}"

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        question, answer = question_and_answer(data)
        answer_type = data.get("answer_type") or ("number" if parse_number(str(answer)) is not None else "text")
        if answer_type not in ("number", "text"):
            raise ValueError("problem.answer_type must be 'number' or 'text'")
        if answer_type == "number" and parse_number(str(answer)) is None:
            raise ValueError(f"problem.answer {answer!r} is not a number")
        if answer_type == "text" and not normalize_text(str(answer)):
            raise ValueError("problem.answer is empty")
        payload: dict[str, Any] = {"answer": str(answer), "answer_type": answer_type}
        if isinstance(data.get("sql"), str):
            payload["sql"] = data["sql"]
        return Problem.make(self.name, question, payload)


def main(argv: list[str] | None = None) -> None:
    """``python -m evertrain.envs.sql [--out data/sql]``: regenerate the vendored table and questions."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "data" / "sql")
    write_data(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
