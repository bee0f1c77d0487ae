"""Add up JUnit XML reports into one 'N passed, N failed' line; exit 1 on failures or no tests."""

import sys
import xml.etree.ElementTree as ET


def main(paths: list[str]) -> int:
    """Print the combined summary of ``paths``; return the exit code."""
    total = failed = skipped = 0
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            print(f"missing or broken report: {path}")
            failed += 1
            continue
        for suite in root.iter("testsuite"):
            total += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    passed = total - failed - skipped
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
