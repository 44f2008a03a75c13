"""An in-memory DynamoDB for the deterministic simulation, with DynamoDB's own expression semantics.

``SimDynamo.handle(op, params)`` takes the kwargs botocore takes and returns the response botocore
would return, or raises ``botocore.exceptions.ClientError`` with the code the real service uses.
It exists because the simulation runs fleetd's own lease, sink and control code thousands of times
in virtual time, where moto's in-process DynamoDB costs milliseconds per call.

Modelled:

* Tables with a hash key and an optional range key; GSIs with KEYS_ONLY / ALL / INCLUDE projection,
  sparse (an item lacking an index key is not in the index), ordered by range key (numbers
  numerically, strings and binaries by bytes), ties by table key.
* GSI lag: with ``index_lag_ms``, every write samples a lag and the index shows that item's new
  image from ``now_ms() + lag`` on, an item's images in write order.  Base-table reads are current.
* ConditionExpression / FilterExpression (comparators, BETWEEN, IN, AND/OR/NOT, parentheses,
  attribute_exists / attribute_not_exists / attribute_type / begins_with / contains / size),
  UpdateExpression (SET with ``+``/``-``, if_not_exists, list_append; REMOVE; ADD for numbers and
  sets; DELETE for sets; nested ``a.b`` / ``a[0]`` paths), ProjectionExpression, #name and :value
  placeholders (undefined or unused ones are errors, bare reserved words are errors).  A comparison
  with a missing attribute is false, except ``<>`` (true) and ``=`` of two missing operands (true, as in
  moto and dynalite); the condition is checked before the update is applied.
* ReturnValues (all five), ReturnValuesOnConditionCheckFailure=ALL_OLD (the item goes to the error
  response's ``Item``), Query / Scan with Limit, ExclusiveStartKey / LastEvaluatedKey (for a GSI
  the table key and the index key), ScanIndexForward, Select, FilterExpression after Limit, 1 MB pages.
* Limits: 25 requests per BatchWriteItem, 100 keys per BatchGetItem, duplicate keys in one batch,
  400 KB items (DynamoDB's size rule, approximately), 38-digit numbers, empty key strings, index
  key types, key attributes in an UpdateExpression.
* CreateTable / DescribeTable / DeleteTable / ListTables / UpdateTimeToLive / DescribeTimeToLive,
  and botocore's client-side check of parameter names (``ParamValidationError``).

Not modelled: capacity, throttling and UnprocessedItems/UnprocessedKeys (a fault layer injects
those), transactions, PartiQL, LSIs, streams, TTL deletion, table/index creation delays, the
legacy parameters (Expected, AttributeUpdates, KeyConditions, QueryFilter, AttributesToGet),
ReturnConsumedCapacity.  Parallel scans split items by a stable hash of their key, not as DynamoDB
does (which items fall in which segment is unspecified there too).  UPDATED_OLD / UPDATED_NEW
return whole top-level attributes even when a nested path was updated.  Numbers are exact
(Python int / Decimal) and returned in canonical form.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import re
import time
import zlib
from collections.abc import Callable, Iterable
from decimal import Decimal, InvalidOperation, localcontext
from operator import itemgetter
from typing import Any

import botocore.session
from botocore.exceptions import ClientError, ParamValidationError

Wire = dict[str, Any]
Item = dict[str, Wire]
Values = dict[str, Wire]
Path = tuple[str | int, ...]
Key = tuple[Any, ...]
Num = int | Decimal
Operand = Callable[[Item, Values], Wire | None]
Cond = Callable[[Item, Values], bool]
SetValue = Callable[[Item, Values], Wire]
Node = tuple[Any, ...]

ITEM_MAX_BYTES = 400 * 1024
PAGE_MAX_BYTES = 1024 * 1024
BATCH_WRITE_MAX = 25
BATCH_GET_MAX = 100
_KEY_TYPES = frozenset({"S", "N", "B"})
_SET_TYPES = frozenset({"SS", "NS", "BS"})
_DEEP_TYPES = frozenset({"SS", "NS", "BS", "L", "M"})
_TYPE_NAMES = ("S", "SS", "N", "NS", "B", "BS", "BOOL", "NULL", "L", "M")
_EXPR_CACHE_MAX = 10_000

_RESERVED_WORDS = """
ABORT ABSOLUTE ACTION ADD AFTER AGENT AGGREGATE ALL ALLOCATE ALTER ANALYZE AND ANY ARCHIVE ARE ARRAY AS ASC
ASCII ASENSITIVE ASSERTION ASYMMETRIC AT ATOMIC ATTACH ATTRIBUTE AUTH AUTHORIZATION AUTHORIZE AUTO AVG BACK
BACKUP BASE BATCH BEFORE BEGIN BETWEEN BIGINT BINARY BIT BLOB BLOCK BOOLEAN BOTH BREADTH BUCKET BULK BY BYTE
CALL CALLED CALLING CAPACITY CASCADE CASCADED CASE CAST CATALOG CHAR CHARACTER CHECK CLASS CLOB CLOSE CLUSTER
CLUSTERED CLUSTERING CLUSTERS COALESCE COLLATE COLLATION COLLECTION COLUMN COLUMNS COMBINE COMMENT COMMIT
COMPACT COMPILE COMPRESS CONDITION CONFLICT CONNECT CONNECTION CONSISTENCY CONSISTENT CONSTRAINT CONSTRAINTS
CONSTRUCTOR CONSUMED CONTINUE CONVERT COPY CORRESPONDING COUNT COUNTER CREATE CROSS CUBE CURRENT CURSOR CYCLE
DATA DATABASE DATE DATETIME DAY DEALLOCATE DEC DECIMAL DECLARE DEFAULT DEFERRABLE DEFERRED DEFINE DEFINED
DEFINITION DELETE DELIMITED DEPTH DEREF DESC DESCRIBE DESCRIPTOR DETACH DETERMINISTIC DIAGNOSTICS DIRECTORIES
DISABLE DISCONNECT DISTINCT DISTRIBUTE DO DOMAIN DOUBLE DROP DUMP DURATION DYNAMIC EACH ELEMENT ELSE ELSEIF
EMPTY ENABLE END EQUAL EQUALS ERROR ESCAPE ESCAPED EVAL EVALUATE EXCEEDED EXCEPT EXCEPTION EXCEPTIONS
EXCLUSIVE EXEC EXECUTE EXISTS EXIT EXPLAIN EXPLODE EXPORT EXPRESSION EXTENDED EXTERNAL EXTRACT FAIL FALSE
FAMILY FETCH FIELDS FILE FILTER FILTERING FINAL FINISH FIRST FIXED FLATTERN FLOAT FOR FORCE FOREIGN FORMAT
FORWARD FOUND FREE FROM FULL FUNCTION FUNCTIONS GENERAL GENERATE GET GLOB GLOBAL GO GOTO GRANT GREATER GROUP
GROUPING HANDLER HASH HAVE HAVING HEAP HIDDEN HOLD HOUR IDENTIFIED IDENTITY IF IGNORE IMMEDIATE IMPORT IN
INCLUDING INCLUSIVE INCREMENT INCREMENTAL INDEX INDEXED INDEXES INDICATOR INFINITE INITIALLY INLINE INNER
INNTER INOUT INPUT INSENSITIVE INSERT INSTEAD INT INTEGER INTERSECT INTERVAL INTO INVALIDATE IS ISOLATION ITEM
ITEMS ITERATE JOIN KEY KEYS LAG LANGUAGE LARGE LAST LATERAL LEAD LEADING LEAVE LEFT LENGTH LESS LEVEL LIKE
LIMIT LIMITED LINES LIST LOAD LOCAL LOCALTIME LOCALTIMESTAMP LOCATION LOCATOR LOCK LOCKS LOG LOGED LONG LOOP
LOWER MAP MATCH MATERIALIZED MAX MAXLEN MEMBER MERGE METHOD METRICS MIN MINUS MINUTE MISSING MOD MODE MODIFIES
MODIFY MODULE MONTH MULTI MULTISET NAME NAMES NATIONAL NATURAL NCHAR NCLOB NEW NEXT NO NONE NOT NULL NULLIF
NUMBER NUMERIC OBJECT OF OFFLINE OFFSET OLD ON ONLINE ONLY OPAQUE OPEN OPERATOR OPTION OR ORDER ORDINALITY
OTHER OTHERS OUT OUTER OUTPUT OVER OVERLAPS OVERRIDE OWNER PAD PARALLEL PARAMETER PARAMETERS PARTIAL PARTITION
PARTITIONED PARTITIONS PATH PERCENT PERCENTILE PERMISSION PERMISSIONS PIPE PIPELINED PLAN POOL POSITION
PRECISION PREPARE PRESERVE PRIMARY PRIOR PRIVATE PRIVILEGES PROCEDURE PROCESSED PROJECT PROJECTION PROPERTY
PROVISIONING PUBLIC PUT QUERY QUIT QUORUM RAISE RANDOM RANGE RANK RAW READ READS REAL REBUILD RECORD RECURSIVE
REDUCE REF REFERENCE REFERENCES REFERENCING REGEXP REGION REINDEX RELATIVE RELEASE REMAINDER RENAME REPEAT
REPLACE REQUEST RESET RESIGNAL RESOURCE RESPONSE RESTORE RESTRICT RESULT RETURN RETURNING RETURNS REVERSE
REVOKE RIGHT ROLE ROLES ROLLBACK ROLLUP ROUTINE ROW ROWS RULE RULES SAMPLE SATISFIES SAVE SAVEPOINT SCAN
SCHEMA SCOPE SCROLL SEARCH SECOND SECTION SEGMENT SEGMENTS SELECT SELF SEMI SENSITIVE SEPARATE SEQUENCE
SERIALIZABLE SESSION SET SETS SHARD SHARE SHARED SHORT SHOW SIGNAL SIMILAR SIZE SKEWED SMALLINT SNAPSHOT SOME
SOURCE SPACE SPACES SPARSE SPECIFIC SPECIFICTYPE SPLIT SQL SQLCODE SQLERROR SQLEXCEPTION SQLSTATE SQLWARNING
START STATE STATIC STATUS STORAGE STORE STORED STREAM STRING STRUCT STYLE SUB SUBMULTISET SUBPARTITION
SUBSTRING SUBTYPE SUM SUPER SYMMETRIC SYNONYM SYSTEM TABLE TABLESAMPLE TEMP TEMPORARY TERMINATED TEXT THAN
THEN THROUGHPUT TIME TIMESTAMP TIMEZONE TINYINT TO TOKEN TOTAL TOUCH TRAILING TRANSACTION TRANSFORM TRANSLATE
TRANSLATION TREAT TRIGGER TRIM TRUE TRUNCATE TTL TUPLE TYPE UNDER UNDO UNION UNIQUE UNIT UNKNOWN UNLOGGED
UNNEST UNPROCESSED UNSIGNED UNTIL UPDATE UPPER URL USAGE USE USER USERS USING UUID VACUUM VALUE VALUED VALUES
VARCHAR VARIABLE VARIANCE VARINT VARYING VIEW VIEWS VIRTUAL VOID WAIT WHEN WHENEVER WHERE WHILE WINDOW WITH
WITHIN WITHOUT WORK WRAPPED WRITE YEAR ZONE
"""
_RESERVED = frozenset(_RESERVED_WORDS.split())


# ----- errors ---------------------------------------------------------------------------------------


class DynamoError(Exception):
    """A DynamoDB error; ``SimDynamo.handle`` turns it into botocore's ``ClientError``."""

    def __init__(self, code: str, message: str, item: Item | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.item = item


def _invalid(message: str) -> DynamoError:
    return DynamoError("ValidationException", message)


def _client_error(e: DynamoError, op: str) -> ClientError:
    resp: dict[str, Any] = {"Error": {"Code": e.code, "Message": e.message},
                            "ResponseMetadata": {"HTTPStatusCode": 400, "RetryAttempts": 0}}
    if e.item is not None:
        resp["Item"] = e.item
    return ClientError(resp, op)


# ----- numbers --------------------------------------------------------------------------------------


def _checked(d: Decimal) -> Num:
    """A finite Decimal within DynamoDB's number range, as an int when integral."""
    if d.is_zero():
        return 0
    with localcontext() as ctx:
        ctx.prec = 200
        d = d.normalize()
    _, digits, exponent = d.as_tuple()
    if len(digits) > 38:
        raise _invalid("Attempting to store more than 38 significant digits in a Number")
    if d.adjusted() > 125:
        raise _invalid("Number overflow. Attempting to store a number with magnitude larger than supported range")
    if d.adjusted() < -130:
        raise _invalid("Number underflow. Attempting to store a number with magnitude smaller than supported range")
    assert isinstance(exponent, int)
    return int(d) if exponent >= 0 else d


def _parse_num(text: Any) -> Num:
    if type(text) is not str:
        raise _invalid("A value provided cannot be converted into a number")
    try:
        d = Decimal(text)
    except InvalidOperation:
        raise _invalid("A value provided cannot be converted into a number") from None
    if not d.is_finite() or text.strip() != text:
        raise _invalid("A value provided cannot be converted into a number")
    return _checked(d)


def _format_num(n: Num) -> str:
    if type(n) is int and -10**38 < n < 10**38:
        return str(n)
    n = _checked(Decimal(n))
    return str(n) if type(n) is int else format(n, "f")


def _canon_num(text: Any) -> str:
    """The canonical text of a number as DynamoDB returns it ("007" → "7", "1.50" → "1.5")."""
    if type(text) is str and text.isdigit() and text.isascii() and len(text) <= 38 and (
            text[0] != "0" or len(text) == 1):
        return text
    return _format_num(_parse_num(text))


def _num(text: str) -> Num:
    """A stored (canonical) number."""
    try:
        return int(text)
    except ValueError:
        return Decimal(text)


def _arith(a: Num, b: Num, sign: int) -> str:
    if type(a) is int and type(b) is int:
        return _format_num(a + sign * b)
    with localcontext() as ctx:
        ctx.prec = 200
        return _format_num(Decimal(a) + sign * Decimal(b))


# ----- attribute values -----------------------------------------------------------------------------


def _ingest(v: Any) -> Wire:
    """A validated private copy of a wire attribute value from a request."""
    if type(v) is dict and len(v) == 1:
        for t, x in v.items():
            if t == "S" and type(x) is str:
                return {"S": x}
            if t == "N":
                return {"N": _canon_num(x)}
            return _ingest_other(t, x)
    raise _invalid("Supplied AttributeValue is empty, must contain exactly one of the supported datatypes")


def _blob(x: Any) -> bytes:
    if isinstance(x, bytes | bytearray):
        return bytes(x)
    if isinstance(x, str):
        return x.encode()
    raise _invalid("Invalid attribute value type")


def _ingest_other(t: str, x: Any) -> Wire:
    if t == "BOOL" and type(x) is bool:
        return {"BOOL": x}
    if t == "NULL":
        if x is not True:
            raise _invalid("One or more parameter values were invalid: Null attribute value types must have the "
                           "value of true")
        return {"NULL": True}
    if t == "B":
        return {"B": _blob(x)}
    if t == "L" and isinstance(x, list):
        return {"L": [_ingest(e) for e in x]}
    if t == "M" and isinstance(x, dict):
        return {"M": {_name(k): _ingest(e) for k, e in x.items()}}
    if t in _SET_TYPES and isinstance(x, list | tuple):
        return {t: _ingest_set(t, list(x))}
    raise _invalid("Supplied AttributeValue has an invalid data type")


def _ingest_set(t: str, xs: list[Any]) -> list[Any]:
    if not xs:
        raise _invalid("One or more parameter values were invalid: An number set  may not be empty"
                       if t == "NS" else "One or more parameter values were invalid: An string set  may not be empty")
    if t == "SS":
        if not all(type(s) is str for s in xs):
            raise _invalid("Supplied AttributeValue has an invalid data type")
        out: list[Any] = xs
        seen: set[Any] = set(xs)
    elif t == "NS":
        out = [_canon_num(s) for s in xs]
        seen = {_num(s) for s in out}
    else:
        out = [_blob(b) for b in xs]
        seen = set(out)
    if len(seen) != len(out):
        raise _invalid(f"One or more parameter values were invalid: Input collection {xs} contains duplicates.")
    return out


def _name(k: Any) -> str:
    if type(k) is not str:
        raise _invalid("Attribute names must be strings")
    return k


def _copy(v: Wire) -> Wire:
    """A copy the caller may mutate (stored values are never mutated in place, so scalars are shared)."""
    for t, x in v.items():
        if t in _DEEP_TYPES:
            if t == "M":
                return {"M": {k: _copy(e) for k, e in x.items()}}
            if t == "L":
                return {"L": [_copy(e) for e in x]}
            return {t: list(x)}
        return {t: x}
    return {}


def _copy_item(item: Item) -> Item:
    return {k: _copy(v) for k, v in item.items()}


def _vsize(v: Wire) -> int:
    for t, x in v.items():
        if t == "S":
            return len(x) if x.isascii() else len(x.encode())
        if t == "N":
            return len(x) // 2 + 1
        if t == "B":
            return len(x)
        if t in ("BOOL", "NULL"):
            return 1
        if t == "SS":
            return sum(len(s.encode()) for s in x)
        if t == "NS":
            return sum(len(s) // 2 + 1 for s in x)
        if t == "BS":
            return sum(len(b) for b in x)
        if t == "L":
            return 3 + sum(1 + _vsize(e) for e in x)
        if t == "M":
            return 3 + sum(1 + len(k.encode()) + _vsize(e) for k, e in x.items())
    return 0


def _attr_size(name: str, v: Wire) -> int:
    return (len(name) if name.isascii() else len(name.encode())) + _vsize(v)


def _item_size(item: Item) -> int:
    return sum(_attr_size(k, v) for k, v in item.items())


def _native(v: Wire, t: str) -> Any:
    """A key value as a Python value that orders like DynamoDB (str by code point = UTF-8 bytes)."""
    x = v[t]
    return _num(x) if t == "N" else x


def _type_of(v: Wire) -> str:
    for t in v:
        return t
    return ""


def _eq(a: Wire | None, b: Wire | None) -> bool:
    if a is None or b is None:
        return False
    if a == b:
        return True
    for ta, xa in a.items():
        xb = b.get(ta)
        if xb is None or len(b) != 1:
            return False
        if ta == "N":
            return bool(_num(xa) == _num(xb))
        if ta == "NS":
            return {_num(s) for s in xa} == {_num(s) for s in xb}
        if ta in ("SS", "BS"):
            return set(xa) == set(xb)
        if ta == "L":
            return len(xa) == len(xb) and all(_eq(p, q) for p, q in zip(xa, xb, strict=True))
        if ta == "M":
            return xa.keys() == xb.keys() and all(_eq(e, xb[k]) for k, e in xa.items())
    return False


def _order(a: Wire | None, b: Wire | None) -> int | None:
    """-1 / 0 / 1, or None when the two cannot be ordered (missing, different or unordered types)."""
    if a is None or b is None:
        return None
    for t, xa in a.items():
        xb = b.get(t)
        if xb is None or t not in _KEY_TYPES:
            return None
        if t == "N":
            xa, xb = _num(xa), _num(xb)
        return -1 if xa < xb else (1 if xa > xb else 0)
    return None


def _size_of(v: Wire | None) -> Wire | None:
    if v is None:
        return None
    for t, x in v.items():
        if t == "S":
            return {"N": str(len(x))}
        if t in ("B", "L", "M") or t in _SET_TYPES:
            return {"N": str(len(x))}
    return None


def _contains(a: Wire | None, b: Wire | None) -> bool:
    if a is None or b is None:
        return False
    for t, x in a.items():
        if t == "S" or t == "B":
            y = b.get(t)
            return y is not None and y in x
        if t in _SET_TYPES:
            return len(b) == 1 and t[0] in b and any(_eq({t[0]: e}, b) for e in x)
        if t == "L":
            return any(_eq(e, b) for e in x)
    return False


def _begins_with(a: Wire | None, b: Wire | None) -> bool:
    if a is None or b is None:
        return False
    for t, x in a.items():
        y = b.get(t)
        return t in ("S", "B") and y is not None and bool(x.startswith(y))
    return False


# ----- document paths -------------------------------------------------------------------------------


def _get(item: Item, path: Path) -> Wire | None:
    v: Wire | None = item.get(path[0])  # type: ignore[arg-type]
    for p in path[1:]:
        if v is None:
            return None
        if type(p) is int:
            seq = v.get("L")
            v = seq[p] if seq is not None and p < len(seq) else None
        else:
            m = v.get("M")
            v = m.get(p) if m is not None else None
    return v


def _bad_path() -> DynamoError:
    return _invalid("The document path provided in the update expression is invalid for update")


def _set_in(container: Wire | None, path: Path, value: Wire) -> Wire:
    """``container`` with ``value`` at ``path``, copied along the path (stored values stay immutable)."""
    p = path[0]
    if container is None:
        raise _bad_path()
    if type(p) is int:
        if "L" not in container:
            raise _bad_path()
        seq = list(container["L"])
        child = value if len(path) == 1 else _set_in(seq[p] if p < len(seq) else None, path[1:], value)
        if p < len(seq):
            seq[p] = child
        else:
            seq.append(child)  # DynamoDB appends when the index is past the end
        return {"L": seq}
    if "M" not in container:
        raise _bad_path()
    m = dict(container["M"])
    m[p] = value if len(path) == 1 else _set_in(m.get(p), path[1:], value)
    return {"M": m}


def _removed_in(container: Wire | None, path: Path) -> Wire | None:
    """``container`` without ``path`` (None: nothing to remove)."""
    if container is None:
        return None
    p = path[0]
    if type(p) is int:
        seq = container.get("L")
        if seq is None or p >= len(seq):
            return None
        seq = list(seq)
        if len(path) == 1:
            del seq[p]
        else:
            child = _removed_in(seq[p], path[1:])
            if child is None:
                return None
            seq[p] = child
        return {"L": seq}
    m = container.get("M")
    if m is None or p not in m:
        return None
    m = dict(m)
    if len(path) == 1:
        del m[p]
    else:
        child = _removed_in(m[p], path[1:])
        if child is None:
            return None
        m[p] = child
    return {"M": m}


def _put_path(item: Item, path: Path, value: Wire) -> None:
    name = path[0]
    assert isinstance(name, str)
    item[name] = value if len(path) == 1 else _set_in(item.get(name), path[1:], value)


def _remove_path(item: Item, path: Path) -> None:
    name = path[0]
    assert isinstance(name, str)
    if len(path) == 1:
        item.pop(name, None)
        return
    changed = _removed_in(item.get(name), path[1:])
    if changed is not None:
        item[name] = changed


def _project(item: Item, paths: Iterable[Path]) -> Item:
    """The parts of ``item`` at ``paths`` (ProjectionExpression), as a fresh copy."""
    out: Item = {}
    for path in paths:
        v = _get(item, path)
        if v is None:
            continue
        if len(path) == 1:
            out[path[0]] = _copy(v)  # type: ignore[index]
        else:
            _merge_into(out, path, _copy(v))
    return out


def _merge_into(out: Item, path: Path, value: Wire) -> None:
    name = path[0]
    assert isinstance(name, str)
    out[name] = _merged(out.get(name), path[1:], value)


def _merged(node: Wire | None, path: Path, value: Wire) -> Wire:
    """Build the nested shape of a projected path (list elements are compacted, as DynamoDB does)."""
    if not path:
        return value
    p = path[0]
    if type(p) is int:
        seq: list[Wire] = node["L"] if node is not None and "L" in node else []
        seq.append(_merged(None, path[1:], value))
        return {"L": seq}
    m: dict[str, Wire] = node["M"] if node is not None and "M" in node else {}
    name = str(p)
    m[name] = _merged(m.get(name), path[1:], value)
    return {"M": m}


# ----- expressions: tokens and parser ----------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(#[A-Za-z0-9_]+)|(:[A-Za-z0-9_]+)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)"
                    r"|(<>|<=|>=|[=<>(),.\[\]+\-]))")
_TOKEN_KINDS = ("ph", "val", "name", "num", "op")
_COMPARATORS = frozenset({"=", "<>", "<", "<=", ">", ">="})
_BOOL_FUNCS = frozenset({"attribute_exists", "attribute_not_exists", "attribute_type", "begins_with", "contains"})
_UPDATE_FUNCS = frozenset({"if_not_exists", "list_append"})
_CLAUSES = ("SET", "REMOVE", "ADD", "DELETE")


def _tokenize(text: str, what: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None:
            near = text[pos:pos + 10].strip()
            raise _invalid(f"Invalid {what}: Syntax error; token: \"{near[:1]}\", near: \"{near}\"")
        kind = _TOKEN_KINDS[m.lastindex - 1]  # type: ignore[operator]
        tokens.append((kind, m.group(m.lastindex)))  # type: ignore[arg-type]
        pos = m.end()
    tokens.append(("end", ""))
    return tokens


class _Parser:
    """Recursive descent over one expression; records the #names and :values it uses."""

    def __init__(self, text: str, names: dict[str, str], what: str) -> None:
        if not text.strip():
            raise _invalid(f"Invalid {what}: The expression can not be empty;")
        self.what = what
        self.tokens = _tokenize(text, what)
        self.i = 0
        self.names = names
        self.names_used: set[str] = set()
        self.values_used: set[str] = set()

    # -- tokens

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def take(self) -> tuple[str, str]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def error(self, tok: tuple[str, str] | None = None) -> DynamoError:
        kind, text = tok or self.peek()
        shown = "<EOF>" if kind == "end" else text
        return _invalid(f"Invalid {self.what}: Syntax error; token: \"{shown}\"")

    def expect(self, text: str) -> None:
        if self.peek() != ("op", text):
            raise self.error()
        self.i += 1

    def is_word(self, word: str, ahead: int = 0) -> bool:
        kind, text = self.peek(ahead)
        return kind == "name" and text.upper() == word

    def is_call(self) -> bool:
        return self.peek()[0] == "name" and self.peek(1) == ("op", "(")

    def done(self) -> None:
        if self.peek()[0] != "end":
            raise self.error()

    # -- operands

    def path(self) -> Path:
        parts: list[str | int] = [self.path_name()]
        while True:
            if self.peek() == ("op", "."):
                self.i += 1
                parts.append(self.path_name())
            elif self.peek() == ("op", "["):
                self.i += 1
                kind, text = self.take()
                if kind != "num":
                    raise self.error((kind, text))
                parts.append(int(text))
                self.expect("]")
            else:
                return tuple(parts)

    def path_name(self) -> str:
        kind, text = self.take()
        if kind == "ph":
            if text not in self.names:
                raise _invalid(f"Invalid {self.what}: An expression attribute name used in the document path is "
                               f"not defined; attribute name: {text}")
            self.names_used.add(text)
            return self.names[text]
        if kind == "name":
            if text.upper() in _RESERVED:
                raise _invalid(f"Invalid {self.what}: Attribute name is a reserved keyword; reserved keyword: {text}")
            return text
        raise self.error((kind, text))

    def value(self) -> Node:
        kind, text = self.take()
        if kind != "val":
            raise self.error((kind, text))
        self.values_used.add(text)
        return ("val", text)

    def operand(self) -> Node:
        kind, text = self.peek()
        if kind == "val":
            return self.value()
        if self.is_call():
            if text != "size":
                if text in _BOOL_FUNCS:
                    raise _invalid(f"Invalid {self.what}: The function is not allowed to be used this way in an "
                                   f"expression; function: {text}")
                raise _invalid(f"Invalid {self.what}: Invalid function name; function: {text}")
            self.i += 2
            node = ("size", self.path())
            self.expect(")")
            return node
        return ("path", self.path())

    # -- conditions

    def condition(self) -> Node:
        node = self.conjunction()
        while self.is_word("OR"):
            self.i += 1
            node = ("or", node, self.conjunction())
        return node

    def conjunction(self) -> Node:
        node = self.negation()
        while self.is_word("AND"):
            self.i += 1
            node = ("and", node, self.negation())
        return node

    def negation(self) -> Node:
        if self.is_word("NOT"):
            self.i += 1
            return ("not", self.negation())
        return self.predicate()

    def predicate(self) -> Node:
        if self.peek() == ("op", "("):
            self.i += 1
            node = self.condition()
            self.expect(")")
            return node
        if self.is_call() and self.peek()[1] in _BOOL_FUNCS:
            return self.function()
        left = self.operand()
        kind, text = self.peek()
        if kind == "op" and text in _COMPARATORS:
            self.i += 1
            return ("cmp", text, left, self.operand())
        if self.is_word("BETWEEN"):
            self.i += 1
            low = self.operand()
            if not self.is_word("AND"):
                raise self.error()
            self.i += 1
            return ("between", left, low, self.operand())
        if self.is_word("IN"):
            self.i += 1
            self.expect("(")
            choices = [self.operand()]
            while self.peek() == ("op", ","):
                self.i += 1
                choices.append(self.operand())
            self.expect(")")
            return ("in", left, tuple(choices))
        if left[0] == "size":
            raise _invalid(f"Invalid {self.what}: The function is not allowed to be used this way in an "
                           "expression; function: size")
        raise self.error()

    def function(self) -> Node:
        name = self.take()[1]
        self.expect("(")
        if self.peek()[0] == "val":
            raise _invalid(f"Invalid {self.what}: Incorrect operand type for operator or function; "
                           f"operator or function: {name}, operand type: value")
        path = self.path()
        args: tuple[Node, ...] = ()
        if name in ("attribute_type", "begins_with", "contains"):
            self.expect(",")
            args = (self.value(),) if name == "attribute_type" else (self.operand(),)
        self.expect(")")
        return ("fn", name, path, *args)

    # -- update expressions

    def update(self) -> list[tuple[str, Path, Node | None]]:
        actions: list[tuple[str, Path, Node | None]] = []
        seen: set[str] = set()
        while self.peek()[0] != "end":
            kind, text = self.take()
            clause = text.upper()
            if kind != "name" or clause not in _CLAUSES:
                raise self.error((kind, text))
            if clause in seen:
                raise _invalid(f"Invalid {self.what}: The \"{clause}\" section can only be used once in an "
                               "update expression;")
            seen.add(clause)
            actions += self.clause(clause)
        return actions

    def clause(self, clause: str) -> list[tuple[str, Path, Node | None]]:
        actions: list[tuple[str, Path, Node | None]] = []
        while True:
            path = self.path()
            if clause == "SET":
                self.expect("=")
                actions.append((clause, path, self.set_value()))
            elif clause == "REMOVE":
                actions.append((clause, path, None))
            else:
                actions.append((clause, path, self.value()))
            if self.peek() != ("op", ","):
                return actions
            self.i += 1

    def set_value(self) -> Node:
        left = self.set_operand()
        kind, text = self.peek()
        if kind == "op" and text in "+-":
            self.i += 1
            return ("arith", text, left, self.set_operand())
        return left

    def set_operand(self) -> Node:
        kind, text = self.peek()
        if kind == "val":
            return self.value()
        if self.is_call():
            if text not in _UPDATE_FUNCS:
                raise _invalid(f"Invalid {self.what}: Invalid function name; function: {text}")
            self.i += 2
            if text == "if_not_exists":
                node: Node = ("if_not_exists", self.path())
            else:
                node = ("list_append", self.set_operand())
            self.expect(",")
            node = (*node, self.set_operand())
            self.expect(")")
            return node
        return ("path", self.path())

    # -- projection

    def projection(self) -> list[Path]:
        paths = [self.path()]
        while self.peek() == ("op", ","):
            self.i += 1
            paths.append(self.path())
        return paths


# ----- expressions: compiled forms -------------------------------------------------------------------


def _compile_operand(node: Node) -> Operand:
    kind, arg = node
    if kind == "val":
        return lambda item, values: values[arg]
    if kind == "size":
        return lambda item, values: _size_of(_get(item, arg))
    if len(arg) == 1:
        name = arg[0]
        return lambda item, values: item.get(name)
    return lambda item, values: _get(item, arg)


_ORDERED: dict[str, Callable[[int], bool]] = {
    "<": lambda c: c < 0, "<=": lambda c: c <= 0, ">": lambda c: c > 0, ">=": lambda c: c >= 0,
}


def _compile_cmp(op: str, left: Node, right: Node) -> Cond:
    a, b = _compile_operand(left), _compile_operand(right)
    if op == "=":
        if left[0] == "path" and len(left[1]) == 1 and right[0] == "val":
            name, ph = left[1][0], right[1]
            return lambda item, values: _eq(item.get(name), values[ph])
        def equal(item: Item, values: Values) -> bool:
            x, y = a(item, values), b(item, values)
            return (x is None and y is None) or _eq(x, y)  # two missing operands are equal (moto, dynalite)
        return equal
    if op == "<>":
        def differ(item: Item, values: Values) -> bool:
            x, y = a(item, values), b(item, values)
            return not (x is None and y is None) and not _eq(x, y)
        return differ
    test = _ORDERED[op]

    def ordered(item: Item, values: Values) -> bool:
        c = _order(a(item, values), b(item, values))
        return c is not None and test(c)
    return ordered


def _compile_fn(name: str, path: Path, args: tuple[Node, ...]) -> Cond:
    top = path[0] if len(path) == 1 else None
    if name == "attribute_exists":
        if top is not None:
            return lambda item, values: top in item
        return lambda item, values: _get(item, path) is not None
    if name == "attribute_not_exists":
        if top is not None:
            return lambda item, values: top not in item
        return lambda item, values: _get(item, path) is None
    arg = _compile_operand(args[0])
    if name == "attribute_type":
        def has_type(item: Item, values: Values) -> bool:
            v = _get(item, path)
            return v is not None and _type_of(v) == values[args[0][1]].get("S")
        return has_type
    if name == "begins_with":
        return lambda item, values: _begins_with(_get(item, path), arg(item, values))
    return lambda item, values: _contains(_get(item, path), arg(item, values))


def _compile_condition(node: Node) -> Cond:
    kind = node[0]
    if kind in ("and", "or"):
        a, b = _compile_condition(node[1]), _compile_condition(node[2])
        if kind == "and":
            return lambda item, values: a(item, values) and b(item, values)
        return lambda item, values: a(item, values) or b(item, values)
    if kind == "not":
        inner = _compile_condition(node[1])
        return lambda item, values: not inner(item, values)
    if kind == "cmp":
        return _compile_cmp(node[1], node[2], node[3])
    if kind == "fn":
        return _compile_fn(node[1], node[2], node[3:])
    x = _compile_operand(node[1])
    if kind == "between":
        lo, hi = _compile_operand(node[2]), _compile_operand(node[3])

        def between(item: Item, values: Values) -> bool:
            v = x(item, values)
            c1, c2 = _order(lo(item, values), v), _order(v, hi(item, values))
            return c1 is not None and c2 is not None and c1 <= 0 and c2 <= 0
        return between
    choices = [_compile_operand(c) for c in node[2]]
    return lambda item, values: any(_eq(x(item, values), c(item, values)) for c in choices)


def _value_checks(node: Node, what: str) -> list[Callable[[Values], None]]:
    """Checks DynamoDB makes on the :values before evaluating anything (types, BETWEEN bounds)."""
    kind = node[0]
    if kind in ("and", "or"):
        return _value_checks(node[1], what) + _value_checks(node[2], what)
    if kind == "not":
        return _value_checks(node[1], what)
    if kind == "cmp" and node[1] in _ORDERED:
        return [_operand_type_check(n, node[1], what, _KEY_TYPES) for n in node[2:4] if n[0] == "val"]
    if kind == "between":
        checks = [_operand_type_check(n, "BETWEEN", what, _KEY_TYPES) for n in node[1:4] if n[0] == "val"]
        if node[2][0] == "val" and node[3][0] == "val":
            checks.append(_bounds_check(node[2][1], node[3][1], what))
        return checks
    if kind == "fn" and node[1] == "begins_with" and node[3][0] == "val":
        return [_operand_type_check(node[3], "begins_with", what, frozenset({"S", "B"}))]
    if kind == "fn" and node[1] == "attribute_type":
        return [_type_name_check(node[3][1], what)]
    return []


def _operand_type_check(node: Node, op: str, what: str, allowed: frozenset[str]) -> Callable[[Values], None]:
    def check(values: Values) -> None:
        t = _type_of(values[node[1]])
        if t not in allowed:
            raise _invalid(f"Invalid {what}: Incorrect operand type for operator or function; "
                           f"operator or function: {op}, operand type: {t}")
    return check


def _bounds_check(lo: str, hi: str, what: str) -> Callable[[Values], None]:
    def check(values: Values) -> None:
        a, b = values[lo], values[hi]
        if _type_of(a) != _type_of(b):
            raise _invalid(f"Invalid {what}: The BETWEEN operator requires same data type for lower and upper "
                           f"bounds; lower bound operand: AttributeValue: {a}, upper bound operand: "
                           f"AttributeValue: {b}")
        c = _order(a, b)
        if c is not None and c > 0:
            raise _invalid(f"Invalid {what}: The BETWEEN operator requires upper bound to be greater than or "
                           f"equal to lower bound; lower bound operand: AttributeValue: {a}, upper bound operand: "
                           f"AttributeValue: {b}")
    return check


def _type_name_check(ph: str, what: str) -> Callable[[Values], None]:
    def check(values: Values) -> None:
        t = values[ph].get("S")
        if t not in _TYPE_NAMES:
            raise _invalid(f"Invalid {what}: Invalid attribute type name found in type: {t}, valid types: "
                           "{ S,SS,N,NS,B,BS,BOOL,NULL,L,M }")
    return check


def _wrong_operand() -> DynamoError:
    return _invalid("An operand in the update expression has an incorrect data type")


def _compile_set_value(node: Node) -> SetValue:
    """A SET right-hand side, evaluated against the item before the update."""
    kind = node[0]
    if kind in ("val", "path"):
        get = _compile_operand(node)

        def present(item: Item, values: Values) -> Wire:
            v = get(item, values)
            if v is None:
                raise _invalid("The provided expression refers to an attribute that does not exist in the item")
            return v
        return present
    if kind == "if_not_exists":
        path, fallback = node[1], _compile_set_value(node[2])
        return lambda item, values: _get(item, path) or fallback(item, values)
    a, b = _compile_set_value(node[-2]), _compile_set_value(node[-1])
    if kind == "list_append":
        def append(item: Item, values: Values) -> Wire:
            x, y = a(item, values), b(item, values)
            if "L" not in x or "L" not in y:
                raise _wrong_operand()
            return {"L": x["L"] + y["L"]}
        return append
    sign = 1 if node[1] == "+" else -1

    def arith(item: Item, values: Values) -> Wire:
        x, y = a(item, values), b(item, values)
        if "N" not in x or "N" not in y:
            raise _wrong_operand()
        return {"N": _arith(_num(x["N"]), _num(y["N"]), sign)}
    return arith


def _add_value(current: Wire | None, v: Wire) -> Wire:
    """ADD: a number adds (a missing attribute counts as 0), a set unions."""
    t = _type_of(v)
    if current is None:
        if t != "N" and t not in _SET_TYPES:
            raise _wrong_operand()
        return v
    if t != _type_of(current):
        raise _wrong_operand()
    if t == "N":
        return {"N": _arith(_num(current["N"]), _num(v["N"]), 1)}
    if t not in _SET_TYPES:
        raise _wrong_operand()
    return {t: _set_union(t, current[t], v[t])}


def _set_union(t: str, a: list[Any], b: list[Any]) -> list[Any]:
    if t != "NS":
        return list(dict.fromkeys([*a, *b]))
    have = {_num(x) for x in a}
    return a + [x for x in b if _num(x) not in have]


def _delete_value(current: Wire | None, v: Wire) -> Wire | None:
    """DELETE: remove the elements of a set (None: the set became empty, remove the attribute)."""
    t = _type_of(v)
    if t not in _SET_TYPES:
        raise _wrong_operand()
    if current is None:
        return None
    if _type_of(current) != t:
        raise _wrong_operand()
    if t == "NS":
        gone = {_num(x) for x in v[t]}
        left = [x for x in current[t] if _num(x) not in gone]
    else:
        gone = set(v[t])
        left = [x for x in current[t] if x not in gone]
    return {t: left} if left else None


def _overlap(paths: list[Path], what: str) -> None:
    for i, p in enumerate(paths):
        for q in paths[i + 1:]:
            n = min(len(p), len(q))
            if p[:n] == q[:n]:
                raise _invalid(f"Invalid {what}: Two document paths overlap with each other; must remove or "
                               f"rewrite one of these paths; path one: {list(p)}, path two: {list(q)}")


class _Expr:
    """One parsed expression (cached by its kind, text and names): what to run and what it refers to."""

    __slots__ = ("actions", "ast", "checks", "cond", "names_used", "paths", "tops", "values_used")

    def __init__(self, parser: _Parser) -> None:
        self.names_used = frozenset(parser.names_used)
        self.values_used = frozenset(parser.values_used)
        self.ast: Node = ()
        self.cond: Cond = lambda item, values: True
        self.checks: list[Callable[[Values], None]] = []
        self.actions: list[tuple[str, Path, Operand | None]] = []
        self.paths: list[Path] = []
        self.tops: frozenset[str] = frozenset()


def _parse(kind: str, text: str, names: dict[str, str]) -> _Expr:
    what = {"cond": "ConditionExpression", "filter": "FilterExpression", "update": "UpdateExpression",
            "proj": "ProjectionExpression", "key": "KeyConditionExpression"}[kind]
    parser = _Parser(text, names, what)
    if kind == "update":
        raw = parser.update()
    elif kind == "proj":
        paths = parser.projection()
    else:
        ast = parser.condition()
    parser.done()
    expr = _Expr(parser)
    if kind == "update":
        expr.paths = [path for _, path, _ in raw]
        _overlap(expr.paths, what)
        expr.actions = [(clause, path, None if node is None else (
            _compile_set_value(node) if clause == "SET" else _compile_operand(node))) for clause, path, node in raw]
        expr.tops = frozenset(str(p[0]) for p in expr.paths)
        expr.checks = [_update_value_check(clause, node[1]) for clause, _, node in raw
                       if clause in ("ADD", "DELETE") and node is not None]
    elif kind == "proj":
        expr.paths = paths
    else:
        expr.ast = ast
        expr.cond = _compile_condition(ast)
        expr.checks = _value_checks(ast, what)
        expr.tops = frozenset(str(p) for p in _top_names(ast))
    return expr


def _update_value_check(clause: str, ph: str) -> Callable[[Values], None]:
    allowed = _SET_TYPES | ({"N"} if clause == "ADD" else set())

    def check(values: Values) -> None:
        t = _type_of(values[ph])
        if t not in allowed:
            raise _invalid(f"Invalid UpdateExpression: Incorrect operand type for operator or function; "
                           f"operator: {clause}, operand type: {t}")
    return check


def _top_names(node: Any) -> Iterable[str | int]:
    """The top-level attribute names a condition refers to."""
    if isinstance(node, tuple) and node and node[0] in ("path", "size") and isinstance(node[1], tuple):
        yield node[1][0]
    elif isinstance(node, tuple) and node and node[0] == "fn":
        yield node[2][0]
        for arg in node[3:]:
            yield from _top_names(arg)
    elif isinstance(node, tuple):
        for part in node:
            yield from _top_names(part)


# ----- indexes ---------------------------------------------------------------------------------------


class _Part:
    """One hash key's entries of an index: sort keys in order, and each table key's image and size."""

    __slots__ = ("images", "order")

    def __init__(self) -> None:
        self.order: list[Any] = []
        self.images: dict[Key, tuple[Item, int]] = {}


_first = itemgetter(0)


def _segment_filter(p: dict[str, Any]) -> Callable[[Key], bool]:
    """Which table keys one segment of a parallel scan covers (a stable hash of the key)."""
    if "Segment" not in p and "TotalSegments" not in p:
        return lambda key: True
    total, segment = int(p.get("TotalSegments", 0)), int(p.get("Segment", -1))
    if not 1 <= total <= 1_000_000 or not 0 <= segment < total:
        raise _invalid("Segment and TotalSegments must be given together, 0 <= Segment < TotalSegments")
    return lambda key: zlib.crc32(repr(key).encode()) % total == segment


class _Index:
    """A sorted view of a table by (hash, range, table key), with images that become visible late.

    Every write hands the index the item's new projected image (None: not in the index).  Without
    lag it applies at once; with lag it waits in ``pending`` until ``advance(now)`` reaches its
    ``visible_at``, which never precedes the same item's previous image's.  ``latest`` holds each
    item's newest image (applied or not), to skip writes that do not change the index.
    """

    def __init__(self, name: str, hash_key: tuple[str, str], range_key: tuple[str, str] | None,
                 projection: dict[str, Any], table_keys: tuple[str, ...]) -> None:
        self.name = name
        self.hash_name, self.hash_type = hash_key
        self.range_name, self.range_type = range_key or ("", "")
        self.kind = projection.get("ProjectionType", "ALL")
        names = dict.fromkeys([*table_keys, self.hash_name, *([self.range_name] if range_key else [])])
        if self.kind == "INCLUDE":
            names.update(dict.fromkeys(projection.get("NonKeyAttributes", [])))
        self.key_names = tuple(dict.fromkeys([*table_keys, self.hash_name, *([self.range_name] if range_key else [])]))
        self.names = tuple(names)
        self.parts: dict[Any, _Part] = {}
        self.where: dict[Key, tuple[Any, Any]] = {}
        self.latest: dict[Key, tuple[int, int, Item | None]] = {}
        self.pending: list[tuple[int, int, Key, Item | None, int]] = []
        self.seq = 0

    def image(self, item: Item | None) -> Item | None:
        if item is None or self.hash_name not in item or (self.range_name and self.range_name not in item):
            return None
        if self.kind == "ALL":
            return item
        return {n: item[n] for n in self.names if n in item}

    def put(self, key: Key, item: Item | None, size: int, now: int, lag: int | None) -> None:
        """Record the item's new state; it shows in the index now, or at ``now + lag`` (in write order)."""
        img = self.image(item)
        prev = self.latest.get(key)
        if prev is None:
            if img is None:
                return
        elif prev[2] is img or prev[2] == img:
            return
        # A projected image's size is estimated from its item's (the 1 MB page rule is approximate).
        isize = size if self.kind == "ALL" or img is None or item is None else size * len(img) // len(item)
        if lag is None:
            self._apply(key, img, isize)
            if img is None:
                del self.latest[key]
            else:
                self.latest[key] = (0, 0, img)
            return
        visible_at = now + lag if prev is None else max(now + lag, prev[0])
        self.seq += 1
        self.latest[key] = (visible_at, self.seq, img)
        heapq.heappush(self.pending, (visible_at, self.seq, key, img, isize))

    def put_base(self, key: Key, item: Item | None, size: int) -> None:
        """The base view of a hash+range table: the item's position follows from its key alone."""
        loc = self.where.get(key)
        if item is None:
            if loc is not None:
                self._unlink(key, loc)
                del self.where[key]
        elif loc is not None:
            self.parts[key[0]].images[key] = (item, size)
        else:
            part = self.parts.get(key[0])
            if part is None:
                part = self.parts[key[0]] = _Part()
            sk = (key[1], key)
            bisect.insort(part.order, sk)
            part.images[key] = (item, size)
            self.where[key] = (key[0], sk)

    def advance(self, now: int) -> None:
        """Apply every image visible at ``now`` (superseded images are dropped as they are replaced)."""
        pending = self.pending
        while pending and pending[0][0] <= now:
            _, seq, key, img, isize = heapq.heappop(pending)
            self._apply(key, img, isize)
            if img is None and self.latest[key][1] == seq:
                del self.latest[key]

    def _apply(self, key: Key, img: Item | None, isize: int) -> None:
        loc = self.where.get(key)
        if img is None:
            if loc is not None:
                self._unlink(key, loc)
                del self.where[key]
            return
        h = _native(img[self.hash_name], self.hash_type)
        sk = (_native(img[self.range_name], self.range_type), key) if self.range_name else key
        if loc is not None:
            if loc[0] == h and loc[1] == sk:
                self.parts[h].images[key] = (img, isize)
                return
            self._unlink(key, loc)
        part = self.parts.get(h)
        if part is None:
            part = self.parts[h] = _Part()
        bisect.insort(part.order, sk)
        part.images[key] = (img, isize)
        self.where[key] = (h, sk)

    def _unlink(self, key: Key, loc: tuple[Any, Any]) -> None:
        part = self.parts[loc[0]]
        del part.order[bisect.bisect_left(part.order, loc[1])]
        del part.images[key]
        if not part.images:
            del self.parts[loc[0]]

    def bounds(self, part: _Part, cond: tuple[Any, ...] | None) -> tuple[int, int]:
        """The slice of ``part.order`` a range key condition selects."""
        order = part.order
        if cond is None:
            return 0, len(order)
        op, v = cond[0], cond[1]
        left = bisect.bisect_left(order, v, key=_first)
        if op == "<":
            return 0, left
        if op == ">=":
            return left, len(order)
        right = bisect.bisect_right(order, v, key=_first)
        if op == "=":
            return left, right
        if op == "<=":
            return 0, right
        if op == ">":
            return right, len(order)
        if op == "between":
            return left, max(left, bisect.bisect_right(order, cond[2], key=_first))
        end = left  # begins_with
        while end < len(order) and order[end][0].startswith(v):
            end += 1
        return left, end

    def sort_key(self, key: Key, img: Item) -> Any:
        return (_native(img[self.range_name], self.range_type), key) if self.range_name else key


# ----- tables ----------------------------------------------------------------------------------------


class _Table:
    """One table: items by key, their sizes, the base view (for Query) and the GSIs."""

    def __init__(self, request: dict[str, Any], description: dict[str, Any]) -> None:
        self.name: str = request["TableName"]
        self.description = description
        self.types = {a["AttributeName"]: a["AttributeType"] for a in request["AttributeDefinitions"]}
        schema = _key_schema(request["KeySchema"], self.types)
        self.hash_name, self.hash_type = schema[0]
        self.range_name, self.range_type = schema[1] or ("", "")
        self.key_names = tuple(n for n, _ in (schema[0], *([schema[1]] if schema[1] else [])))
        self.items: dict[Key, Item] = {}
        self.sizes: dict[Key, int] = {}
        self.base = _Index("", schema[0], schema[1], {"ProjectionType": "ALL"}, self.key_names)
        self.indexes: dict[str, _Index] = {}
        for g in request.get("GlobalSecondaryIndexes", []):
            ix = _key_schema(g["KeySchema"], self.types)
            self.indexes[g["IndexName"]] = _Index(g["IndexName"], ix[0], ix[1], g["Projection"], self.key_names)
        self.index_keys = {n: self.types[n] for ix in self.indexes.values()
                           for n in (ix.hash_name, ix.range_name) if n}
        self.ttl: dict[str, Any] | None = None
        self.scan_order: list[Key] | None = None

    def key(self, raw: Any) -> Key:
        """The internal key of a request's ``Key`` (exactly the key attributes, with their types)."""
        if type(raw) is not dict or len(raw) != len(self.key_names):
            raise _invalid("The provided key element does not match the schema")
        h = raw.get(self.hash_name)
        if type(h) is not dict or len(h) != 1 or self.hash_type not in h:
            raise _invalid("The provided key element does not match the schema")
        hv = self._key_value(h, self.hash_name, self.hash_type)
        if not self.range_name:
            return (hv,)
        r = raw.get(self.range_name)
        if type(r) is not dict or len(r) != 1 or self.range_type not in r:
            raise _invalid("The provided key element does not match the schema")
        return (hv, self._key_value(r, self.range_name, self.range_type))

    def _key_value(self, v: Wire, name: str, t: str) -> Any:
        x = v[t]
        if t == "N":
            return _num(_canon_num(x))
        if t == "S" and type(x) is str and x:
            return x
        if t == "B" and isinstance(x, bytes | bytearray | str) and x:
            return _blob(x)
        if x == "" or x == b"":
            raise _invalid("One or more parameter values are not valid. The AttributeValue for a key attribute "
                           f"cannot contain an empty string value. Key: {name}")
        raise _invalid("The provided key element does not match the schema")

    def item_key(self, item: Item) -> Key:
        """The key of an ingested item (PutItem): every key attribute present, of its type, not empty."""
        h = item.get(self.hash_name)
        x = None if h is None else h.get(self.hash_type)
        if x:
            hv = _num(x) if self.hash_type == "N" else x
            if not self.range_name:
                return (hv,)
            r = item.get(self.range_name)
            y = None if r is None else r.get(self.range_type)
            if y:
                return (hv, _num(y) if self.range_type == "N" else y)
        return self._item_key_checked(item)

    def _item_key_checked(self, item: Item) -> Key:
        key: list[Any] = []
        for name, t in ((self.hash_name, self.hash_type), (self.range_name, self.range_type)):
            if not name:
                break
            v = item.get(name)
            if v is None:
                raise _invalid(f"One or more parameter values were invalid: Missing the key {name} in the item")
            if t not in v:
                raise _invalid(f"One or more parameter values were invalid: Type mismatch for key {name} "
                               f"expected: {t} actual: {_type_of(v)}")
            key.append(self._key_value(v, name, t))
        return tuple(key)

    def key_item(self, raw: dict[str, Any]) -> Item:
        """The item UpdateItem starts from when none exists: just its key."""
        return {n: _ingest(raw[n]) for n in self.key_names}

    def check(self, item: Item) -> None:
        """What a write must satisfy beyond its key: index key types (the size is checked by the caller)."""
        for name, t in self.index_keys.items():
            v = item.get(name)
            if v is None or t in v:
                if v is not None and (v[t] == "" or v[t] == b""):
                    ix = next(i.name for i in self.indexes.values() if name in (i.hash_name, i.range_name))
                    raise _invalid("One or more parameter values are not valid. A value specified for a secondary "
                                   "index key is not supported. The AttributeValue for a key attribute cannot "
                                   f"contain an empty string value. IndexName: {ix}, IndexKey: {name}")
                continue
            ix = next(i.name for i in self.indexes.values() if name in (i.hash_name, i.range_name))
            raise _invalid(f"One or more parameter values were invalid: Type mismatch for Index Key {name} "
                           f"Expected: {t} Actual: {_type_of(v)} IndexName: {ix}")

    def store(self, key: Key, item: Item | None, size: int, now: int, lag: Callable[[], int] | None) -> None:
        """Commit a write (None: delete) to the table, its base view and its GSIs."""
        if item is None:
            if self.items.pop(key, None) is not None:
                del self.sizes[key]
                self.scan_order = None
        else:
            if key not in self.items:
                self.scan_order = None
            self.items[key] = item
            self.sizes[key] = size
        if self.range_name:
            self.base.put_base(key, item, size)
        for ix in self.indexes.values():
            ix.put(key, item, size, now, None if lag is None else lag())

    def ordered_keys(self) -> list[Key]:
        if self.scan_order is None:
            self.scan_order = sorted(self.items)
        return self.scan_order


def _key_schema(schema: Any, types: dict[str, str]) -> tuple[tuple[str, str], tuple[str, str] | None]:
    if not isinstance(schema, list) or not 1 <= len(schema) <= 2 or schema[0].get("KeyType") != "HASH" or (
            len(schema) == 2 and schema[1].get("KeyType") != "RANGE"):
        raise _invalid("1 validation error detected: Invalid KeySchema: The first KeySchemaElement is not a HASH "
                       "key type, or a RANGE key is not second")
    out: list[tuple[str, str]] = []
    for k in schema:
        name = k.get("AttributeName")
        if name not in types:
            raise _invalid("One or more parameter values were invalid: Some index key attributes are not defined in "
                           f"AttributeDefinitions. Keys: [{name}], AttributeDefinitions: {sorted(types)}")
        if types[name] not in _KEY_TYPES:
            raise _invalid(f"Member must satisfy enum value set: [B, N, S] ({name})")
        out.append((name, types[name]))
    return out[0], (out[1] if len(out) == 2 else None)


# ----- requests --------------------------------------------------------------------------------------

_EMPTY: Item = {}
_EXPRS: dict[tuple[str, str, Any], _Expr] = {}  # shared by every SimDynamo: expressions are pure
_PARAMS: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
_SERVICE: list[Any] = []
_UPDATE_RETURNS = frozenset({"NONE", "ALL_NEW", "ALL_OLD", "UPDATED_NEW", "UPDATED_OLD"})
_SELECTS = frozenset({"ALL_ATTRIBUTES", "ALL_PROJECTED_ATTRIBUTES", "SPECIFIC_ATTRIBUTES", "COUNT"})
_LEGACY = ("Expected", "AttributeUpdates", "KeyConditions", "QueryFilter", "ScanFilter", "AttributesToGet",
           "ConditionalOperator")
_CREATED = "2026-01-01T00:00:00+00:00"


def _wall_ms() -> int:
    return int(time.time() * 1000)


def _check_params(op: str, params: dict[str, Any]) -> None:
    """botocore's client-side check of top-level parameter names (the shapes inside are checked later)."""
    names = _PARAMS.get(op)
    if names is None:
        if not _SERVICE:
            _SERVICE.append(botocore.session.get_session().get_service_model("dynamodb"))
        shape = _SERVICE[0].operation_model(op).input_shape
        names = _PARAMS[op] = (frozenset(shape.members), frozenset(shape.required_members))
    allowed, required = names
    for name in params:
        if name not in allowed:
            raise ParamValidationError(report=f"Unknown parameter in input: \"{name}\", must be one of: "
                                              f"{', '.join(sorted(allowed))}")
    for name in required:
        if name not in params:
            raise ParamValidationError(report=f"Missing required parameter in input: \"{name}\"")
    for name in _LEGACY:
        if name in params:
            raise _invalid(f"SimDynamo does not model the legacy parameter {name}")


def _expr(kind: str, text: Any, names: dict[str, str] | None) -> _Expr:
    cache_key = (kind, text, tuple(names.items()) if names else None)
    expr = _EXPRS.get(cache_key)
    if expr is None:
        if type(text) is not str:
            raise _invalid(f"Invalid expression: {text!r} is not a string")
        if len(_EXPRS) >= _EXPR_CACHE_MAX:
            _EXPRS.clear()
        expr = _EXPRS[cache_key] = _parse(kind, text, names or {})
    return expr


def _prepare(p: dict[str, Any], wanted: tuple[tuple[str, str], ...]) -> tuple[Values, list[_Expr | None]]:
    """Parse (cached) the request's expressions, ingest its :values, and check every placeholder."""
    names = p.get("ExpressionAttributeNames")
    raw = p.get("ExpressionAttributeValues")
    exprs: list[_Expr | None] = []
    used_names: frozenset[str] = frozenset()
    used_values: frozenset[str] = frozenset()
    for kind, param in wanted:
        text = p.get(param)
        if text is None:
            exprs.append(None)
            continue
        e = _expr(kind, text, names)
        exprs.append(e)
        used_names = used_names | e.names_used if used_names else e.names_used
        used_values = used_values | e.values_used if used_values else e.values_used
    values = _ingest_item(raw)[0] if raw else {}
    present = [e for e in exprs if e is not None]
    if names is not None and names.keys() != used_names:
        _check_unused("ExpressionAttributeNames", names, present, used_names)
    if raw is not None and raw.keys() != used_values:
        _check_unused("ExpressionAttributeValues", raw, present, used_values)
        for name in used_values:
            if name not in values:
                raise _invalid(f"Invalid expression: An expression attribute value used in expression is not "
                               f"defined; attribute value: {name}")
    if raw is None and used_values:
        raise _invalid(f"Invalid expression: An expression attribute value used in expression is not defined; "
                       f"attribute value: {min(used_values)}")
    for e in present:
        for check in e.checks:
            check(values)
    return values, exprs


def _check_unused(param: str, given: Any, present: list[_Expr], used: frozenset[str]) -> None:
    if not isinstance(given, dict) or not given:
        raise _invalid(f"{param} must not be empty")
    if not present:
        raise _invalid(f"{param} can only be specified when using expressions")
    unused = [k for k in given if k not in used]
    if unused:
        raise _invalid(f"Value provided in {param} unused in expressions: keys: {{{', '.join(unused)}}}")


def _ingest_item(raw: Any) -> tuple[Item, int]:
    """A private copy of a request's item, and its size (one pass: the sink's hot path)."""
    if not isinstance(raw, dict):
        raise _invalid("Item must be a map")
    item: Item = {}
    size = 0
    for k, v in raw.items():
        try:
            ((t, x),) = v.items()
        except (AttributeError, ValueError):
            t = x = None
        if t == "S" and x.__class__ is str and k.__class__ is str:
            item[k] = {"S": x}
            size += len(k) + (len(x) if x.isascii() else len(x.encode()))
        elif t == "N" and x.__class__ is str and k.__class__ is str and x.isdigit() and len(x) <= 38 and (
                x[0] != "0" or len(x) == 1) and x.isascii():
            item[k] = {"N": x}
            size += len(k) + len(x) // 2 + 1
        else:
            w = item[_name(k)] = _ingest(v)
            size += _attr_size(k, w)
    return item, size


def _check_size(size: int) -> None:
    if size > ITEM_MAX_BYTES:
        raise _invalid("Item size has exceeded the maximum allowed size")


def _failed(old: Item | None, p: dict[str, Any]) -> DynamoError:
    on_fail = p.get("ReturnValuesOnConditionCheckFailure", "NONE")
    item = _copy_item(old) if on_fail == "ALL_OLD" and old is not None else None
    return DynamoError("ConditionalCheckFailedException", "The conditional request failed", item)


def _return_values(p: dict[str, Any], allowed: frozenset[str]) -> str:
    rv: str = p.get("ReturnValues", "NONE")
    if rv not in allowed:
        raise _invalid("Return values set to invalid value")
    if p.get("ReturnValuesOnConditionCheckFailure", "NONE") not in ("NONE", "ALL_OLD"):
        raise _invalid("ReturnValuesOnConditionCheckFailure set to invalid value")
    return rv


def _limit(p: dict[str, Any]) -> int | None:
    limit = p.get("Limit")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise _invalid("1 validation error detected: Value at 'limit' failed to satisfy constraint: "
                       "Member must have value greater than or equal to 1")
    return limit


def _apply_update(upd: _Expr, old: Item, values: Values) -> Item:
    """The item after an UpdateExpression; every operand reads the item as it was before."""
    results = [(clause, path, None if fn is None else fn(old, values)) for clause, path, fn in upd.actions]
    new = dict(old)
    for clause, path, v in results:
        if clause == "SET":
            assert v is not None
            _put_path(new, path, v)
        elif clause == "REMOVE":
            _remove_path(new, path)
        elif clause == "ADD":
            assert v is not None
            _put_path(new, path, _add_value(_get(old, path), v))
        else:
            assert v is not None
            left = _delete_value(_get(old, path), v)
            if left is None:
                _remove_path(new, path)
            else:
                _put_path(new, path, left)
    return new


def _updated(rv: str, upd: _Expr | None, old: Item | None, new: Item) -> dict[str, Any]:
    if rv == "NONE":
        return {}
    src = new if rv in ("ALL_NEW", "UPDATED_NEW") else old
    if src is None:
        return {}
    tops = None if rv.startswith("ALL") or upd is None else upd.tops
    attrs = _copy_item(src) if tops is None else {n: _copy(src[n]) for n in tops if n in src}
    return {"Attributes": attrs} if attrs else {}


def _out(img: Item, proj: _Expr | None) -> Item:
    return _copy_item(img) if proj is None else _project(img, proj.paths)


class SimDynamo:
    """DynamoDB in memory: ``handle(op, params)`` answers like botocore's client method of that op.

    ``now_ms`` is the (virtual) clock the GSI lag is measured on; ``index_lag_ms`` samples one
    write's lag (called once per GSI per write).  Without ``index_lag_ms`` GSIs are current.
    """

    def __init__(self, now_ms: Callable[[], int] | None = None,
                 index_lag_ms: Callable[[], int] | None = None) -> None:
        self.now_ms = now_ms or _wall_ms
        self.index_lag_ms = index_lag_ms
        self.tables: dict[str, _Table] = {}
        self._handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "UpdateItem": self.update_item, "PutItem": self.put_item, "GetItem": self.get_item,
            "DeleteItem": self.delete_item, "Query": self.query, "Scan": self.scan,
            "BatchGetItem": self.batch_get_item, "BatchWriteItem": self.batch_write_item,
            "CreateTable": self.create_table, "DescribeTable": self.describe_table, "DeleteTable": self.delete_table,
            "ListTables": self.list_tables, "UpdateTimeToLive": self.update_time_to_live,
            "DescribeTimeToLive": self.describe_time_to_live,
        }

    def handle(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        handler = self._handlers.get(op)
        if handler is None:
            raise _client_error(DynamoError("UnknownOperationException", f"SimDynamo does not model {op}"), op)
        try:
            _check_params(op, params)
            resp = handler(params)
        except DynamoError as e:
            raise _client_error(e, op) from None
        resp["ResponseMetadata"] = {"HTTPStatusCode": 200, "RetryAttempts": 0}
        return resp

    # ----- helpers

    def table(self, name: Any) -> _Table:
        t = self.tables.get(name)
        if t is None:
            raise DynamoError("ResourceNotFoundException", f"Requested resource not found: Table: {name} not found")
        return t

    def _now(self) -> int:
        return self.now_ms() if self.index_lag_ms is not None else 0

    # ----- single items

    def update_item(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        key = t.key(p["Key"])
        values, (upd, cond) = _prepare(p, (("update", "UpdateExpression"), ("cond", "ConditionExpression")))
        rv = _return_values(p, _UPDATE_RETURNS)
        if upd is not None:
            for name in t.key_names:
                if name in upd.tops:
                    raise _invalid(f"One or more parameter values were invalid: Cannot update attribute {name}. "
                                   "This attribute is part of the key")
        old = t.items.get(key)
        if cond is not None and not cond.cond(old or _EMPTY, values):
            raise _failed(old, p)
        base = old if old is not None else t.key_item(p["Key"])
        new = dict(base) if upd is None else _apply_update(upd, base, values)
        size = t.sizes[key] if old is not None else _item_size(base)
        for name in (upd.tops if upd is not None else ()):
            size += (_attr_size(name, new[name]) if name in new else 0) - (
                _attr_size(name, base[name]) if name in base else 0)
        _check_size(size)
        t.check(new)
        t.store(key, new, size, self._now(), self.index_lag_ms)
        return _updated(rv, upd, old, new)

    def put_item(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        item, size = _ingest_item(p["Item"])
        key = t.item_key(item)
        values, (cond,) = _prepare(p, (("cond", "ConditionExpression"),))
        rv = _return_values(p, frozenset({"NONE", "ALL_OLD"}))
        _check_size(size)
        t.check(item)
        old = t.items.get(key)
        if cond is not None and not cond.cond(old or _EMPTY, values):
            raise _failed(old, p)
        t.store(key, item, size, self._now(), self.index_lag_ms)
        return {"Attributes": _copy_item(old)} if rv == "ALL_OLD" and old is not None else {}

    def delete_item(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        key = t.key(p["Key"])
        values, (cond,) = _prepare(p, (("cond", "ConditionExpression"),))
        rv = _return_values(p, frozenset({"NONE", "ALL_OLD"}))
        old = t.items.get(key)
        if cond is not None and not cond.cond(old or _EMPTY, values):
            raise _failed(old, p)
        if old is not None:
            t.store(key, None, 0, self._now(), self.index_lag_ms)
        return {"Attributes": _copy_item(old)} if rv == "ALL_OLD" and old is not None else {}

    def get_item(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        key = t.key(p["Key"])
        _, (proj,) = _prepare(p, (("proj", "ProjectionExpression"),))
        item = t.items.get(key)
        return {} if item is None else {"Item": _out(item, proj)}

    # ----- batches

    def batch_get_item(self, p: dict[str, Any]) -> dict[str, Any]:
        requests = p["RequestItems"]
        if not isinstance(requests, dict) or not requests:
            raise _invalid("1 validation error detected: Value at 'requestItems' failed to satisfy constraint: "
                           "Member must have length greater than or equal to 1")
        if sum(len(r.get("Keys", ())) for r in requests.values()) > BATCH_GET_MAX:
            raise _invalid("Too many items requested for the BatchGetItem call")
        plans = [self._batch_get_plan(name, r) for name, r in requests.items()]
        responses = {name: [_out(t.items[k], proj) for k in keys if k in t.items] for name, t, keys, proj in plans}
        return {"Responses": responses, "UnprocessedKeys": {}}

    def _batch_get_plan(self, name: str, r: dict[str, Any]) -> tuple[str, _Table, list[Key], _Expr | None]:
        t = self.table(name)
        raw_keys = r.get("Keys")
        if not raw_keys:
            raise _invalid("1 validation error detected: Value at 'requestItems.keys' failed to satisfy "
                           "constraint: Member must have length greater than or equal to 1")
        if "ExpressionAttributeValues" in r:
            raise _invalid("ExpressionAttributeValues can only be specified when using expressions")
        _, (proj,) = _prepare(r, (("proj", "ProjectionExpression"),))
        keys = [t.key(k) for k in raw_keys]
        if len(set(keys)) != len(keys):
            raise _invalid("Provided list of item keys contains duplicates")
        return name, t, keys, proj

    def batch_write_item(self, p: dict[str, Any]) -> dict[str, Any]:
        requests = p["RequestItems"]
        if not isinstance(requests, dict) or not requests or any(
                not isinstance(r, list) or not r for r in requests.values()):
            raise _invalid("1 validation error detected: Value at 'requestItems' failed to satisfy constraint: "
                           "Member must have length greater than or equal to 1")
        if sum(len(r) for r in requests.values()) > BATCH_WRITE_MAX:
            raise _invalid("1 validation error detected: Value at 'requestItems' failed to satisfy constraint: "
                           "Map value must satisfy constraint: [Member must have length less than or equal to 25, "
                           "Member must have length greater than or equal to 1]")
        plan = [w for name, reqs in requests.items() for w in self._batch_write_plan(name, reqs)]
        now = self._now()
        for t, key, item, size in plan:
            if item is not None or key in t.items:
                t.store(key, item, size, now, self.index_lag_ms)
        return {"UnprocessedItems": {}}

    def _batch_write_plan(self, name: str, reqs: list[Any]) -> list[tuple[_Table, Key, Item | None, int]]:
        t = self.table(name)
        plan: list[tuple[_Table, Key, Item | None, int]] = []
        seen: set[Key] = set()
        for r in reqs:
            if not isinstance(r, dict) or len(r) != 1:
                raise _invalid("Supplied AttributeValue has an invalid data type")
            if "PutRequest" in r:
                item, size = _ingest_item(r["PutRequest"].get("Item"))
                key = t.item_key(item)
                _check_size(size)
                t.check(item)
                plan.append((t, key, item, size))
            elif "DeleteRequest" in r:
                key = t.key(r["DeleteRequest"].get("Key"))
                plan.append((t, key, None, 0))
            else:
                raise _invalid("Supplied AttributeValue has an invalid data type")
            if key in seen:
                raise _invalid("Provided list of item keys contains duplicates")
            seen.add(key)
        return plan

    # ----- reads of many items

    def query(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        index_name = p.get("IndexName")
        view = self._view(t, index_name, p)
        if "KeyConditionExpression" not in p:
            raise _invalid("Either the KeyConditions or KeyConditionExpression parameter must be specified in the "
                           "request.")
        values, (keyc, filt, proj) = _prepare(p, (("key", "KeyConditionExpression"), ("filter", "FilterExpression"),
                                                  ("proj", "ProjectionExpression")))
        assert keyc is not None
        hname, htype = (view.hash_name, view.hash_type) if view else (t.hash_name, t.hash_type)
        rname, rtype = (view.range_name, view.range_type) if view else ("", "")
        h, rcond = _key_condition(keyc.ast, (hname, htype), (rname, rtype), values)
        if filt is not None:
            for name in (hname, rname):
                if name and name in filt.tops:
                    raise _invalid(f"Filter Expression can only contain non-primary key attributes: Primary key "
                                   f"attribute: {name}")
        count_only = _select(p, index_name, view, proj)
        limit = _limit(p)
        forward = p.get("ScanIndexForward", True) is not False
        rows: Iterable[tuple[Item, int]]
        if view is None:
            rows = self._hash_only_rows(t, h, p.get("ExclusiveStartKey"))
            key_names = t.key_names
        else:
            if index_name:
                view.advance(self._now())
            rows = self._view_rows(t, view, h, rcond, p.get("ExclusiveStartKey"), forward)
            key_names = view.key_names
        return _page(rows, limit, filt, proj, values, key_names, count_only)

    def _view(self, t: _Table, index_name: Any, p: dict[str, Any]) -> _Index | None:
        if index_name is None:
            return t.base if t.range_name else None
        view = t.indexes.get(index_name)
        if view is None:
            raise _invalid(f"The table does not have the specified index: {index_name}")
        if p.get("ConsistentRead"):
            raise _invalid("Consistent reads are not supported on global secondary indexes")
        return view

    def _hash_only_rows(self, t: _Table, h: Any, start: Any) -> list[tuple[Item, int]]:
        if start is not None:
            t.key(start)
            return []
        item = t.items.get((h,))
        return [] if item is None else [(item, t.sizes[(h,)])]

    def _view_rows(self, t: _Table, view: _Index, h: Any, rcond: tuple[Any, ...] | None, start: Any,
                   forward: bool) -> Iterable[tuple[Item, int]]:
        part = view.parts.get(h)
        start_sk = None if start is None else _start_sort_key(t, view, start)
        if part is None:
            return []
        lo, hi = view.bounds(part, rcond)
        order = part.order
        if start_sk is not None:
            if forward:
                lo = max(lo, bisect.bisect_right(order, start_sk))
            else:
                hi = min(hi, bisect.bisect_left(order, start_sk))
        images = part.images
        positions = range(lo, hi) if forward else range(hi - 1, lo - 1, -1)
        if view.range_name:
            return (images[order[i][1]] for i in positions)
        return (images[order[i]] for i in positions)

    def scan(self, p: dict[str, Any]) -> dict[str, Any]:
        """Scan of the table or of a GSI (its lagged view), whole or one segment of a parallel scan."""
        t = self.table(p["TableName"])
        index_name = p.get("IndexName")
        view = None if index_name is None else self._view(t, index_name, p)
        values, (filt, proj) = _prepare(p, (("filter", "FilterExpression"), ("proj", "ProjectionExpression")))
        count_only = _select(p, index_name, view, proj)
        limit = _limit(p)
        segment = _segment_filter(p)
        start = p.get("ExclusiveStartKey")
        if view is None:
            order = t.ordered_keys()
            lo = 0 if start is None else bisect.bisect_right(order, t.key(start))
            items, sizes = t.items, t.sizes
            rows: Iterable[tuple[Item, int]] = ((items[k], sizes[k]) for k in order[lo:] if segment(k))
            return _page(rows, limit, filt, proj, values, t.key_names, count_only)
        view.advance(self._now())
        entries = [(k, img) for h in sorted(view.parts) for k, img in self._index_entries(view, view.parts[h])]
        if start is not None:
            after = t.key({n: start[n] for n in (t.hash_name, t.range_name) if n and n in start})
            entries = entries[next((i + 1 for i, (k, _) in enumerate(entries) if k == after), len(entries)):]
        return _page((img for k, img in entries if segment(k)), limit, filt, proj, values, view.key_names,
                     count_only)

    @staticmethod
    def _index_entries(view: _Index, part: _Part) -> Iterable[tuple[Key, tuple[Item, int]]]:
        for sk in part.order:
            key = sk[1] if view.range_name else sk
            yield key, part.images[key]

    # ----- tables

    def create_table(self, p: dict[str, Any]) -> dict[str, Any]:
        name = p["TableName"]
        if name in self.tables:
            raise DynamoError("ResourceInUseException", f"Table already exists: {name}")
        desc = _table_description(p)
        self.tables[name] = _Table(p, desc)
        return {"TableDescription": copy.deepcopy(desc)}

    def describe_table(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        desc = copy.deepcopy(t.description)
        desc["ItemCount"] = len(t.items)
        desc["TableSizeBytes"] = sum(t.sizes.values())
        for g in desc.get("GlobalSecondaryIndexes", []):
            g["ItemCount"] = len(t.indexes[g["IndexName"]].where)
        return {"Table": desc}

    def delete_table(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        del self.tables[t.name]
        desc = copy.deepcopy(t.description)
        desc["TableStatus"] = "DELETING"
        return {"TableDescription": desc}

    def list_tables(self, p: dict[str, Any]) -> dict[str, Any]:
        names = sorted(self.tables)
        start = p.get("ExclusiveStartTableName")
        if start is not None:
            names = names[bisect.bisect_right(names, start):]
        limit = p.get("Limit", 100)
        resp: dict[str, Any] = {"TableNames": names[:limit]}
        if len(names) > limit:
            resp["LastEvaluatedTableName"] = names[limit - 1]
        return resp

    def update_time_to_live(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        spec = dict(p["TimeToLiveSpecification"])
        enabled = t.ttl is not None and t.ttl["Enabled"]
        if spec.get("Enabled") and enabled:
            raise _invalid("TimeToLive is already enabled")
        if not spec.get("Enabled") and not enabled:
            raise _invalid("TimeToLive is already disabled")
        t.ttl = spec
        return {"TimeToLiveSpecification": dict(spec)}

    def describe_time_to_live(self, p: dict[str, Any]) -> dict[str, Any]:
        t = self.table(p["TableName"])
        if t.ttl is None or not t.ttl["Enabled"]:
            return {"TimeToLiveDescription": {"TimeToLiveStatus": "DISABLED"}}
        return {"TimeToLiveDescription": {"TimeToLiveStatus": "ENABLED", "AttributeName": t.ttl["AttributeName"]}}


def _page(rows: Iterable[tuple[Item, int]], limit: int | None, filt: _Expr | None, proj: _Expr | None,
          values: Values, key_names: tuple[str, ...], count_only: bool) -> dict[str, Any]:
    """One Query/Scan page: read up to ``limit`` items or 1 MB, then filter (as DynamoDB does)."""
    out: list[Item] = []
    scanned = size = 0
    last: Item | None = None
    for img, isize in rows:
        scanned += 1
        size += isize
        if filt is None or filt.cond(img, values):
            out.append(img)
        if scanned == limit or size >= PAGE_MAX_BYTES:
            last = img
            break
    resp: dict[str, Any] = {"Count": len(out), "ScannedCount": scanned}
    if not count_only:
        resp["Items"] = [_out(img, proj) for img in out]
    if last is not None:
        resp["LastEvaluatedKey"] = {n: _copy(last[n]) for n in key_names}
    return resp


def _select(p: dict[str, Any], index_name: str | None, view: _Index | None, proj: _Expr | None) -> bool:
    """Validate Select against the request; True for COUNT."""
    select = p.get("Select")
    if select is None:
        return False
    if select not in _SELECTS:
        raise _invalid(f"1 validation error detected: Value '{select}' at 'select' failed to satisfy constraint")
    if proj is not None and select != "SPECIFIC_ATTRIBUTES":
        raise _invalid(f"Cannot specify the ProjectionExpression when choosing to get {select}")
    if select == "ALL_PROJECTED_ATTRIBUTES" and not index_name:
        raise _invalid("ALL_PROJECTED_ATTRIBUTES can be used only when Querying using an IndexName")
    if select == "ALL_ATTRIBUTES" and index_name and view is not None and view.kind != "ALL":
        raise _invalid(f"One or more parameter values were invalid: Select type ALL_ATTRIBUTES is not supported for "
                       f"global secondary index {index_name} because its projection type is not ALL")
    return bool(select == "COUNT")


def _start_sort_key(t: _Table, view: _Index, start: Any) -> Any:
    """The position of an ExclusiveStartKey in a view (table key, and the index key for a GSI)."""
    if not isinstance(start, dict) or any(n not in start for n in view.key_names) or len(start) != len(
            view.key_names):
        raise _invalid("The provided starting key is invalid: The provided key element does not match the schema")
    key = t.key({n: start[n] for n in t.key_names})
    if not view.range_name:
        return key
    v = start[view.range_name]
    if not isinstance(v, dict) or view.range_type not in v:
        raise _invalid("The provided starting key is invalid: The provided key element does not match the schema")
    return (_native(_ingest(v), view.range_type), key)


_FLIPPED = {"=": "=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _key_condition(ast: Node, hash_key: tuple[str, str], range_key: tuple[str, str],
                   values: Values) -> tuple[Any, tuple[Any, ...] | None]:
    """The hash value and the range condition (op, native values…) of a KeyConditionExpression."""
    conds = [ast[1], ast[2]] if ast[0] == "and" else [ast]
    h: Any = None
    rcond: tuple[Any, ...] | None = None
    for c in conds:
        name, op, phs = _key_term(c)
        if name == hash_key[0] and op == "=" and h is None:
            h = _key_operand(values[phs[0]], hash_key[1])
        elif name == range_key[0] and rcond is None:
            if op == "begins_with" and range_key[1] == "N":
                raise _invalid("Invalid KeyConditionExpression: Incorrect operand type for operator or function; "
                               "operator or function: begins_with, operand type: N")
            rcond = (op, *(_key_operand(values[ph], range_key[1]) for ph in phs))
        else:
            raise _invalid("Query key condition not supported")
    if h is None:
        raise _invalid(f"Query condition missed key schema element: {hash_key[0]}")
    return h, rcond


def _key_term(c: Node) -> tuple[str, str, tuple[str, ...]]:
    """(attribute, operator, value placeholders) of one key condition term."""
    kind = c[0]
    if kind == "cmp":
        op, left, right = c[1], c[2], c[3]
        if left[0] == "val" and right[0] == "path":
            op, left, right = _FLIPPED.get(op, op), right, left
        if op in _FLIPPED and left[0] == "path" and len(left[1]) == 1 and right[0] == "val":
            return left[1][0], op, (right[1],)
    elif kind == "between" and c[1][0] == "path" and len(c[1][1]) == 1 and c[2][0] == c[3][0] == "val":
        return c[1][1][0], "between", (c[2][1], c[3][1])
    elif kind == "fn" and c[1] == "begins_with" and len(c[2]) == 1 and c[3][0] == "val":
        return c[2][0], "begins_with", (c[3][1],)
    op = c[1] if kind in ("cmp", "fn") else kind.upper()
    raise _invalid(f"Invalid operator used in KeyConditionExpression: {op}")


def _key_operand(v: Wire, t: str) -> Any:
    if t not in v:
        raise _invalid("One or more parameter values were invalid: Condition parameter type does not match schema "
                       "type")
    return _native(v, t)


def _table_description(p: dict[str, Any]) -> dict[str, Any]:
    """DescribeTable's view of a CreateTable request, after checking it as DynamoDB does."""
    name = p["TableName"]
    defs = p["AttributeDefinitions"]
    types = {a["AttributeName"]: a["AttributeType"] for a in defs}
    if len(types) != len(defs):
        raise _invalid("Cannot have two attributes with the same name")
    used = {k["AttributeName"] for k in p["KeySchema"]}
    _key_schema(p["KeySchema"], types)
    if p.get("LocalSecondaryIndexes"):
        raise _invalid("SimDynamo does not model local secondary indexes")
    gsis = p.get("GlobalSecondaryIndexes", [])
    if len({g["IndexName"] for g in gsis}) != len(gsis):
        raise _invalid("One or more parameter values were invalid: Duplicate index name")
    for g in gsis:
        _key_schema(g["KeySchema"], types)
        used |= {k["AttributeName"] for k in g["KeySchema"]}
        kind = g.get("Projection", {}).get("ProjectionType")
        if kind not in ("KEYS_ONLY", "ALL", "INCLUDE") or (kind == "INCLUDE") != bool(
                g["Projection"].get("NonKeyAttributes")):
            raise _invalid(f"One or more parameter values were invalid: bad projection of index {g['IndexName']}")
    if set(types) != used:
        raise _invalid("One or more parameter values were invalid: Some AttributeDefinitions are not used. "
                       f"AttributeDefinitions: {sorted(types)}, keys used: {sorted(used)}")
    billing = p.get("BillingMode", "PROVISIONED")
    if billing == "PROVISIONED" and "ProvisionedThroughput" not in p:
        raise _invalid("One or more parameter values were invalid: ReadCapacityUnits and WriteCapacityUnits must "
                       "both be specified when BillingMode is PROVISIONED")
    arn = f"arn:aws:dynamodb:us-east-1:123456789012:table/{name}"
    throughput = {"NumberOfDecreasesToday": 0, "ReadCapacityUnits": 0, "WriteCapacityUnits": 0,
                  **p.get("ProvisionedThroughput", {})}
    desc: dict[str, Any] = {
        "AttributeDefinitions": copy.deepcopy(defs), "TableName": name, "KeySchema": copy.deepcopy(p["KeySchema"]),
        "TableStatus": "ACTIVE", "CreationDateTime": _CREATED, "ProvisionedThroughput": throughput,
        "TableSizeBytes": 0, "ItemCount": 0, "TableArn": arn, "TableId": f"sim-{name}",
        "BillingModeSummary": {"BillingMode": billing}, "DeletionProtectionEnabled": False,
    }
    if gsis:
        desc["GlobalSecondaryIndexes"] = [{
            "IndexName": g["IndexName"], "KeySchema": copy.deepcopy(g["KeySchema"]),
            "Projection": copy.deepcopy(g["Projection"]), "IndexStatus": "ACTIVE",
            "ProvisionedThroughput": dict(throughput), "IndexSizeBytes": 0, "ItemCount": 0,
            "IndexArn": f"{arn}/index/{g['IndexName']}"} for g in gsis]
    return desc
