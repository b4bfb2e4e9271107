"""Python tool: values, stdout, and the sandbox (timeout, network, files, os)."""

import time

import pytest

from rljax import envs
from rljax import tasks

ARITH = tasks.Example(prompt="Compute 6 * 7.", answer=42)


def run(code, **kwargs):
    return envs.run_python(code, **kwargs)


def test_value_of_last_expression():
    outcome = run("x = 6\nx * 7")
    assert outcome.ok and outcome.text == "42"


def test_stdout_then_value():
    outcome = run("print('hi')\n[1, 2]")
    assert outcome.ok and outcome.text == "hi\n[1, 2]"


def test_output_is_truncated():
    outcome = run("print('a' * 5000)", max_output_chars=100)
    assert outcome.ok and outcome.text.startswith("a" * 100 + "... [")


def test_exception_is_an_error_observation():
    outcome = run("1 / 0")
    assert not outcome.ok
    assert outcome.text == "ZeroDivisionError: division by zero"


def test_hang_is_killed_at_the_timeout():
    start = time.monotonic()
    outcome = run("while True: pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert outcome.timeout and not outcome.ok
    assert 1.0 <= elapsed < 1.0 + 2.0


@pytest.mark.parametrize("code", [
    'import socket; socket.create_connection(("127.0.0.1", 9))',
    'open("x", "w")',
    'import os; os.open("x", os.O_WRONLY | os.O_CREAT)',
    'open("/etc/passwd").read()',
    'import pathlib; pathlib.Path("/etc/passwd").read_text()',
    # Inside the stdlib directory, climbing out with "..".
    'import os; open(os.path.dirname(os.__file__) + "/../../../../../etc/passwd")',
    # A path object could pass the check as one path and open another.
    "class P:\n    def __fspath__(self): return '/etc/passwd'\nopen(P())",
    "__import__('os').system('true')",
    "import subprocess; subprocess.run(['true'])",
    "import os; os.fork()",
    "import os; os.kill(os.getppid(), 0)",
    "import os; os.remove('/tmp/nothing')",
    "import ctypes",
    "import gc; gc.get_objects()",
])
def test_sandbox_blocks(code):
    outcome = run(code)
    assert not outcome.ok and not outcome.timeout
    assert outcome.text.startswith("PermissionError: sandbox"), outcome.text


def test_stdlib_still_imports():
    outcome = run("import fractions, json, collections\n"
                  "collections.Counter('aab')['a'] + fractions.Fraction(1, 2)")
    assert outcome.ok and outcome.text == "Fraction(5, 2)"


def test_stdlib_c_modules_find_their_libraries_in_the_sandbox():
    # zlib, hashlib and decimal load shared libraries (libz, libcrypto,
    # libmpdec) that the sandbox must have bound.
    outcome = run("import zlib, hashlib, decimal, math\n"
                  "(zlib.crc32(b'abc'), "
                  "hashlib.sha256(b'abc').hexdigest()[:8], "
                  "str(decimal.Decimal(1) / 7)[:6], math.comb(5, 2))")
    # crc32("abc") = 0x352441C2 = 891568578; sha256("abc") = ba7816bf...
    assert outcome.text == "(891568578, 'ba7816bf', '0.1428', 10)"


def test_python_env_episode_counts_timeouts():
    env = envs.get_env("python", tasks.get_task("arithmetic"), timeout_s=1.0,
                       tool_bonus=0.1)
    env.reset(ARITH)
    result = env.step("<python>\n```python\nprint(6 * 7)\n```\n</python>")
    assert result.observation[0]["content"] == "Tool result: 42"
    assert result.reward == 0.1
    result = env.step("<python>while True: pass</python>")
    assert result.observation[0]["content"].startswith("Tool error: timed out")
    assert result.info["tool_timeout"] and not result.info["tool_ok"]
    result = env.step("<python>import socket</python>")
    assert result.observation[0]["content"].startswith(
        "Tool error: PermissionError")
    result = env.step("42")
    assert (result.reward, result.done) == (1.0, True)
    metrics = env.metrics()
    assert (metrics["tool_calls"], metrics["tool_ok"],
            metrics["tool_timeouts"]) == (3, 1, 1)
