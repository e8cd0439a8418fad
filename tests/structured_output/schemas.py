"""20 pydantic models of varied shape (nested objects, arrays, enums, number ranges, optional
fields) for the structured-output tests. Strings and arrays are bounded: a random-weight model
samples almost uniformly among the tokens the grammar allows, and an unbounded string would
close only by chance."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field

S = Field(max_length=8)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Person(BaseModel):
    name: str = S
    age: int = Field(ge=0, le=130)


class Flags(BaseModel):
    on: bool
    off: bool


class Address(BaseModel):
    street: str = S
    city: str = S
    zip: str = Field(pattern=r"^[0-9]{5}$")


class WithAddress(BaseModel):
    person: Person
    address: Address


class Tags(BaseModel):
    tags: list[Annotated[str, Field(max_length=5)]] = Field(max_length=3)


class Scores(BaseModel):
    scores: list[int] = Field(min_length=1, max_length=4)


class Paint(BaseModel):
    color: Color
    opacity: float = Field(ge=0, le=1)


class Mode(BaseModel):
    mode: Literal["fast", "slow", "auto"]
    level: int = Field(ge=1, le=5)


class MaybeNote(BaseModel):
    title: str = S
    note: Optional[str] = Field(default=None, max_length=6)


class Polygon(BaseModel):
    points: list[Point] = Field(min_length=1, max_length=3)


class Team(BaseModel):
    lead: Person
    members: list[Person] = Field(max_length=2)


class Measurement(BaseModel):
    value: float = Field(ge=-10, le=10)
    unit: Literal["m", "s", "kg"]


class Deep(BaseModel):
    a: Flags
    b: Mode


class Deeper(BaseModel):
    inner: Deep
    point: Point


class Order(BaseModel):
    id: int = Field(ge=1, le=9999)
    items: list[Literal["tea", "cake", "soup"]] = Field(min_length=1, max_length=3)
    paid: bool


class Event(BaseModel):
    name: str = S
    day: int = Field(ge=1, le=31)
    month: int = Field(ge=1, le=12)
    where: Optional[Address] = None


class Matrix(BaseModel):
    rows: list[Annotated[list[int], Field(max_length=2)]] = Field(max_length=2)


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    verdict: Literal["good", "bad"]
    fine: Optional[bool] = None


class Empty(BaseModel):
    pass


MODELS = [
    Point,
    Person,
    Flags,
    Address,
    WithAddress,
    Tags,
    Scores,
    Paint,
    Mode,
    MaybeNote,
    Polygon,
    Team,
    Measurement,
    Deep,
    Deeper,
    Order,
    Event,
    Matrix,
    Review,
    Empty,
]
assert len(MODELS) == 20
