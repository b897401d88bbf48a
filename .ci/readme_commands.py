"""Print the commands of README.md's first ```bash block, one per line (comments dropped).

.ci/run executes these, so CI runs exactly what the README tells a new user to run.
"""
import sys


def first_bash_block(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if not inside and stripped.startswith("```bash"):
            inside = True
        elif inside and stripped.startswith("```"):
            break
        elif inside and stripped and not stripped.startswith("#"):
            lines.append(stripped)
    return lines


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as handle:
        print("\n".join(first_bash_block(handle.read())))
