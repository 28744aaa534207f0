"""Records for tests of the counting rules: only the fields a test sets, every other field None."""

from __future__ import annotations

from dataclasses import fields

from evalpipe.harness.records import Record

_FIELDS = tuple(f.name for f in fields(Record))


def as_record(obj: dict) -> Record:
    """The Record of a partial object: the rules under test read only the fields it sets; keys that are not fields
    (a test's own bookkeeping) are left out, as `Record.from_json` leaves them out."""
    return Record(**{name: obj.get(name) for name in _FIELDS})
