"""The GPU lane's summary: one row per test of a pytest junit XML (test, result, seconds), the
failures' first line under the table. Usage: python3 .ci/gpu/junit_table.py JUNIT.xml"""

import sys
import xml.etree.ElementTree as ET


def rows(path: str) -> list[tuple[str, str, float, str]]:
    """(test, result, seconds, first line of the failure) for each test case of `path`."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        result, why = "pass", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                result = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
                text = (found.get("message") or found.text or "").strip()
                why = text.splitlines()[0][:160] if text else ""
                break
        out.append((name, result, float(case.get("time") or 0.0), why))
    return out


def table(found: list[tuple[str, str, float, str]]) -> str:
    width = max([len(r[0]) for r in found] + [4])
    lines = [f"{'test':<{width}}  result  seconds", f"{'-' * width}  ------  -------"]
    lines += [f"{n:<{width}}  {r:<6}  {s:7.1f}" for n, r, s, _ in found]
    bad = [(n, why) for n, r, _, why in found if r in ("FAIL", "ERROR")]
    counts = {k: sum(r[1] == k for r in found) for k in ("pass", "FAIL", "ERROR", "skip")}
    lines.append(", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no tests ran")
    lines += [f"{n}: {why}" for n, why in bad]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        print(table(rows(sys.argv[1])))
    except (OSError, ET.ParseError, IndexError) as err:
        print(f"junit_table: no test table ({type(err).__name__}: {err})")
        sys.exit(1)
