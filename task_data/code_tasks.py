"""A small set of code tasks with unit tests, written for this project (the code-reward path).

Each task is a prompt, a canonical solution (kept here, never put in a prompt record) and
unit tests: assert lines for function tasks, stdin/stdout pairs for program tasks. A prompt
record's `answer` is the JSON test spec that `areal_core.reward.code:code_reward` reads:

    {"prompt_id": "code-train-3", "prompt": "Write a Python function ...",
     "answer": '{"tests": ["assert fizzbuzz(3) == [...]", ...]}', "meta": {"task": "fizzbuzz"}}

`load(num_train, num_eval)` splits the tasks deterministically: every fourth task is held out
for eval; the train split cycles through the rest up to `num_train` records (0: each once).
"""

from __future__ import annotations

import json
from typing import Any

FENCE = "Reply with the code in a ```python block."


def _fn(name: str, signature: str, text: str, solution: str, tests: list[str]) -> dict[str, Any]:
    prompt = f"Write a Python function `{signature}` that {text} {FENCE}"
    return {"name": name, "prompt": prompt, "solution": solution, "tests": tests}


def _io(name: str, text: str, solution: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    prompt = f"Write a Python program that {text} {FENCE}"
    tests = [{"stdin": i, "stdout": o} for i, o in cases]
    return {"name": name, "prompt": prompt, "solution": solution, "tests": tests}


TASKS: list[dict[str, Any]] = [
    _fn(
        "digit_sum",
        "digit_sum(n)",
        "returns the sum of the decimal digits of the non-negative integer n.",
        "def digit_sum(n):\n    return sum(int(c) for c in str(n))\n",
        [
            "assert digit_sum(0) == 0\nassert digit_sum(1234) == 10",
            "assert digit_sum(7) == 7\nassert digit_sum(99999) == 45",
            "assert digit_sum(10) == 1 and digit_sum(505) == 10",
            "assert digit_sum(1000001) == 2 and digit_sum(86) == 14",
        ],
    ),
    _fn(
        "is_palindrome",
        "is_palindrome(s)",
        "returns True when the string s reads the same backwards, ignoring case and every character "
        "that is not a letter or digit.",
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
        [
            "assert is_palindrome('A man, a plan, a canal: Panama') is True\n"
            "assert is_palindrome('race a car') is False",
            "assert is_palindrome('') is True\nassert is_palindrome('ab') is False",
            "assert is_palindrome('No lemon, no melon') is True\nassert is_palindrome('No lemon, no melons') is False",
            "assert is_palindrome('Was it a car or a cat I saw?') is True\nassert is_palindrome('0P') is False",
        ],
    ),
    _fn(
        "fizzbuzz",
        "fizzbuzz(n)",
        "returns a list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
        "'FizzBuzz' for multiples of both, otherwise the number itself as a string.",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
        "        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
        "        out.append(s or str(i))\n    return out\n",
        [
            "assert fizzbuzz(0) == []\nassert fizzbuzz(1) == ['1']",
            "assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']",
            "assert fizzbuzz(15)[-1] == 'FizzBuzz'\nassert fizzbuzz(15)[9] == 'Buzz'",
            "assert len(fizzbuzz(100)) == 100 and fizzbuzz(100).count('FizzBuzz') == 6",
        ],
    ),
    _fn(
        "reverse_words",
        "reverse_words(s)",
        "returns the words of s in reverse order, separated by single spaces, without leading or trailing spaces.",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        [
            "assert reverse_words('the sky is blue') == 'blue is sky the'",
            "assert reverse_words('  hello   world  ') == 'world hello'",
            "assert reverse_words('one') == 'one'\nassert reverse_words('one two') == 'two one'",
            "assert reverse_words('') == ''\nassert reverse_words(' a  b ') == 'b a'",
        ],
    ),
    _fn(
        "count_vowels",
        "count_vowels(s)",
        "returns how many vowels (a, e, i, o, u, in either case) the string s contains.",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        [
            "assert count_vowels('') == 0\nassert count_vowels('a') == 1",
            "assert count_vowels('Hello World') == 3",
            "assert count_vowels('AEIOUaeiou') == 10",
            "assert count_vowels('rhythm') == 0\nassert count_vowels('queue') == 4",
        ],
    ),
    _fn(
        "second_largest",
        "second_largest(nums)",
        "returns the second largest distinct value in the list nums, or None when there is no such value.",
        "def second_largest(nums):\n    s = sorted(set(nums))\n    return s[-2] if len(s) >= 2 else None\n",
        [
            "assert second_largest([3, 1, 4, 1, 5]) == 4",
            "assert second_largest([2, 2, 2]) is None\nassert second_largest([2, 3, 2]) == 2",
            "assert second_largest([]) is None\nassert second_largest([7, 7, 8]) == 7",
            "assert second_largest([-1, -5, -3]) == -3",
            "assert second_largest([10, 9]) == 9",
        ],
    ),
    _fn(
        "run_length",
        "run_length(s)",
        "returns the run-length encoding of s: each run of a repeated character becomes the character "
        "followed by the run's length, e.g. 'aaabcc' -> 'a3b1c2'.",
        "def run_length(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
        "        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
        [
            "assert run_length('aaabcc') == 'a3b1c2'",
            "assert run_length('') == ''\nassert run_length('zz') == 'z2'",
            "assert run_length('z') == 'z1'",
            "assert run_length('aaaaaaaaaaaa') == 'a12'",
            "assert run_length('abab') == 'a1b1a1b1'",
        ],
    ),
    _fn(
        "gcd",
        "gcd(a, b)",
        "returns the greatest common divisor of the non-negative integers a and b (gcd(0, 0) is 0), "
        "without importing anything.",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
        [
            "assert gcd(12, 18) == 6\nassert gcd(14, 21) == 7",
            "assert gcd(17, 5) == 1\nassert gcd(100, 75) == 25",
            "assert gcd(0, 9) == 9\nassert gcd(9, 0) == 9\nassert gcd(4, 6) == 2",
            "assert gcd(0, 0) == 0\nassert gcd(1, 1) == 1\nassert gcd(48, 180) == 12",
        ],
    ),
    _fn(
        "is_prime",
        "is_prime(n)",
        "returns True when the integer n is a prime number and False otherwise.",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
        "        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
        [
            "assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]",
            "assert is_prime(-7) is False\nassert is_prime(2) is True",
            "assert is_prime(7919) is True\nassert is_prime(1) is False",
            "assert is_prime(7917) is False\nassert is_prime(97) is True",
        ],
    ),
    _fn(
        "flatten",
        "flatten(items)",
        "returns a flat list of all non-list values in the arbitrarily nested list items, in order.",
        "def flatten(items):\n    out = []\n    for x in items:\n"
        "        if isinstance(x, list):\n            out.extend(flatten(x))\n"
        "        else:\n            out.append(x)\n"
        "    return out\n",
        [
            "assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]",
            "assert flatten([]) == []\nassert flatten([[1], 2]) == [1, 2]",
            "assert flatten([[[]]]) == []\nassert flatten([[[0]]]) == [0]",
            "assert flatten(['a', ['b'], [['c']]]) == ['a', 'b', 'c']",
        ],
    ),
    _fn(
        "merge_sorted",
        "merge_sorted(a, b)",
        "merges the two ascending lists a and b into one ascending list (keeping duplicates).",
        "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
        "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
        [
            "assert merge_sorted([1, 3, 5], [2, 4, 6]) == [1, 2, 3, 4, 5, 6]",
            "assert merge_sorted([], [1]) == [1]\nassert merge_sorted([2], []) == [2]",
            "assert merge_sorted([1, 1], [1]) == [1, 1, 1]",
            "assert merge_sorted([], []) == []\nassert merge_sorted([5], [0, 9]) == [0, 5, 9]",
        ],
    ),
    _fn(
        "roman_to_int",
        "roman_to_int(s)",
        "converts the Roman numeral s (I, V, X, L, C, D, M, with subtractive pairs like IV and CM) to an integer.",
        "def roman_to_int(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n"
        "    total = 0\n    for i, c in enumerate(s):\n"
        "        if i + 1 < len(s) and v[c] < v[s[i + 1]]:\n            total -= v[c]\n"
        "        else:\n            total += v[c]\n    return total\n",
        [
            "assert roman_to_int('III') == 3",
            "assert roman_to_int('IX') == 9",
            "assert roman_to_int('LVIII') == 58",
            "assert roman_to_int('MCMXCIV') == 1994",
        ],
    ),
    _fn(
        "word_counts",
        "word_counts(text)",
        "returns a dict mapping each lower-cased word of text (words are separated by whitespace) "
        "to how often it occurs.",
        "def word_counts(text):\n    out = {}\n    for w in text.lower().split():\n        out[w] = out.get(w, 0) + 1\n"
        "    return out\n",
        [
            "assert word_counts('a b a') == {'a': 2, 'b': 1}",
            "assert word_counts('') == {}\nassert word_counts('x') == {'x': 1}",
            "assert word_counts('The the THE') == {'the': 3}",
        ],
    ),
    _fn(
        "balanced",
        "balanced(s)",
        "returns True when every bracket in s ((), [], {}) is closed in the right order; other characters are ignored.",
        "def balanced(s):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n    for c in s:\n"
        "        if c in '([{':\n            stack.append(c)\n"
        "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n                return False\n"
        "    return not stack\n",
        [
            "assert balanced('([]{})') is True\nassert balanced('(]') is False",
            "assert balanced('([)]') is False\nassert balanced('[()]') is True",
            "assert balanced('((') is False\nassert balanced('()') is True",
            "assert balanced('a(b)c') is True\nassert balanced('a(b') is False",
            "assert balanced('') is True\nassert balanced(')(') is False",
        ],
    ),
    _io(
        "sum_line",
        "reads one line of space-separated integers from standard input and prints their sum.",
        "print(sum(int(x) for x in input().split()))\n",
        [
            ("1 2 3\n", "6"),
            ("-5 5 -12\n", "-12"),
            ("40 2\n", "42"),
            ("100 200 300 400\n", "1000"),
        ],
    ),
    _io(
        "reverse_lines",
        "reads an integer n on the first line of standard input, then n lines, "
        "and prints those lines in reverse order.",
        "n = int(input())\nlines = [input() for _ in range(n)]\nprint('\\n'.join(reversed(lines)))\n",
        [
            ("3\na\nb\nc\n", "c\nb\na"),
            ("2\nfirst\nlast\n", "last\nfirst"),
            ("2\nx y\nz\nextra\n", "z\nx y"),
        ],
    ),
    _io(
        "max_min",
        "reads space-separated integers on one line of standard input and prints the largest and the smallest, "
        "separated by a space.",
        "xs = [int(x) for x in input().split()]\nprint(max(xs), min(xs))\n",
        [("3 9 -2 7\n", "9 -2"), ("5\n", "5 5"), ("-1 -1 -3\n", "-1 -3")],
    ),
    _io(
        "count_words",
        "reads all of standard input and prints the number of whitespace-separated words in it.",
        "import sys\nprint(len(sys.stdin.read().split()))\n",
        [
            ("hello world\n", "2"),
            ("  lone\twords here  \n\n", "3"),
            ("a\nb  c\n\nd\n", "4"),
        ],
    ),
]


def record(task: dict[str, Any], prompt_id: str) -> dict[str, Any]:
    return {
        "prompt_id": prompt_id,
        "prompt": task["prompt"],
        "answer": json.dumps({"tests": task["tests"]}),
        "meta": {"task": task["name"]},
    }


def load(num_train: int = 0, num_eval: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) prompt records; eval holds every fourth task, never seen in train."""
    held = [t for i, t in enumerate(TASKS) if i % 4 == 3]
    rest = [t for i, t in enumerate(TASKS) if i % 4 != 3]
    n_train = num_train or len(rest)
    n_eval = min(num_eval or len(held), len(held))
    train = [record(rest[i % len(rest)], f"code-train-{i}") for i in range(n_train)]
    evals = [record(held[i], f"code-eval-{i}") for i in range(n_eval)]
    return train, evals
