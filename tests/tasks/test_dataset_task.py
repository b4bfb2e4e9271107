"""The dataset task: local files through HF datasets, offline, checked rows."""

import json
import logging
import os
import pathlib
import runpy
import textwrap

import pytest

from rljax import tasks
from rljax.tasks import dataset as dataset_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gsm_synth" / "train.jsonl"


def _rows(n=40):
    return [{"question": f"What is {i} + {i}?", "answer": str(2 * i),
             "solution": f"{i} + {i} = {2 * i}\n#### {2 * i}", "level": i % 3}
            for i in range(n)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(tmp_path):
    return _jsonl(tmp_path / "d.jsonl", _rows())


def _task(path, **kwargs):
    return tasks.get_task("dataset", path=path, **kwargs)


# --- reading files --------------------------------------------------------------


def test_jsonl_parquet_and_csv_give_the_same_examples(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = _rows()
    rows[3]["answer"] = "007"  # CSV must keep it as text, not the number 7.
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    csv = tmp_path / "d.csv"
    import csv as csv_lib
    with open(csv, "w", newline="") as f:
        writer = csv_lib.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    kwargs = dict(scorer="exact", template="{prompt} (level {level})")
    built = [_task(str(p), **kwargs) for p in (jsonl, parquet, csv)]
    streams = [[t.train_example(i) for i in range(60)] for t in built]
    assert streams[0] == streams[1] == streams[2]
    held_out = [t.eval_split(len(t._data.held_out)) for t in built]
    assert held_out[0] == held_out[1] == held_out[2]
    csv_rows = {e.meta["row"]: e for e in built[2]._data.train + held_out[2]}
    assert csv_rows[3].answer == "007"
    assert streams[0][0].prompt.endswith(")") and "(level " in streams[0][0].prompt


def test_hub_name_fails_at_once_naming_path():
    with pytest.raises(ValueError, match=r"path='openai/gsm8k' is not a local "
                                         r"file.*never a hub name"):
        _task("openai/gsm8k")
    with pytest.raises(ValueError, match="path is required"):
        _task("")


def test_reading_is_offline(data):
    _task(data, scorer="exact")
    import datasets
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert datasets.config.HF_HUB_OFFLINE
    # datasets itself now refuses the hub without trying the network.
    with pytest.raises(Exception, match="(?i)offline"):
        datasets.load_dataset("openai/gsm8k", split="train")


def test_unknown_file_type_lists_valid_endings(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"unknown file type.*\.jsonl.*\.parquet"
                                         r".*\.csv"):
        _task(str(path))


def test_broken_json_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n{"question": "b" "answer"'
                    ': 2}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl: cannot read it as json: "
                                         r"line 2: invalid JSON"):
        _task(str(path))


# --- columns and rows ---------------------------------------------------------------


def test_prompt_field_is_found_or_named(tmp_path):
    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(20)]
    task = _task(_jsonl(tmp_path / "p.jsonl", rows), scorer="exact")
    assert task._data.prompt_field == "problem"
    rows = [{"text": f"p{i}", "answer": str(i)} for i in range(20)]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(ValueError, match=r"no prompt column \(looked for prompt, "
                                         r"question, problem\).*columns: text, answer"):
        _task(path)
    assert _task(path, prompt_field="text", scorer="exact").train_example(0)
    with pytest.raises(ValueError, match=r"prompt_field='txt' is not a column; "
                                         r"columns: text, answer"):
        _task(path, prompt_field="txt")


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(answer_field="final"), r"answer_field='final' is not a column; "
                                 r"columns: question, answer, solution, level"),
    (dict(few_shot=1, few_shot_field="worked"), r"few_shot_field='worked' is "
                                                r"not a column"),
    (dict(template="{prompt} {grade}"), r"template field \{grade\} is not "
                                        r"'prompt' or a column"),
    (dict(template="{prompt.upper}"), r"template field \{prompt.upper\}"),
    (dict(template="{prompt"), r"not a format string"),
    (dict(scorer="fuzzy"), r"scorer='fuzzy' is not a scorer; valid: math, "
                           r"exact, regex or 'package.module:function'"),
    (dict(extract="tags"), r"extract='tags' is not an extraction mode"),
    (dict(on_bad_row="ignore"), r"on_bad_row='ignore'; valid: error, skip"),
    (dict(score_timeout_s=0), r"score_timeout_s=0 must be > 0"),
    (dict(few_shot=-1), r"few_shot=-1 must be an int >= 0"),
    (dict(few_shot=100), r"few_shot=100 needs more than that many train rows"),
])
def test_config_errors_name_the_field(data, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _task(data, **kwargs)


@pytest.mark.parametrize("row, field, problem", [
    ({"answer": "1"}, "question", "missing"),
    ({"question": "   ", "answer": "1"}, "question", "empty prompt"),
    ({"question": 5, "answer": "1"}, "question", "must be a string, got int"),
    ({"question": "q"}, "answer", "missing"),
    ({"question": "q", "answer": ""}, "answer", "empty answer"),
    ({"question": "q", "answer": [1]}, "answer", "must be a string or a number"),
    ({"question": "q", "answer": "\\"}, "answer", "unparseable answer"),
])
def test_bad_row_error_names_file_row_and_field(tmp_path, row, field, problem):
    rows = _rows(10)
    rows.insert(4, row)
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as err:
        _task(path)  # scorer="math": the answer must parse with math-verify.
    message = str(err.value)
    assert f"bad.jsonl: row 4: field {field!r}: {problem}" in message, message


def test_unparseable_answers_per_scorer(tmp_path):
    rows = _rows(10) + [{"question": "q", "answer": "(unclosed"}]
    path = _jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 10: field 'answer': unparseable "
                                         r"answer: not a valid RE2 pattern"):
        _task(path, scorer="regex")
    path = _jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(ValueError, match=r"row 0: field 'answer': unparseable "
                                         r"answer: no '####' in it"):
        _task(path, answer_after="####")


def test_skip_counts_and_logs_bad_rows(tmp_path, caplog):
    rows = _rows(30)
    rows[2] = {"question": "", "answer": "1"}
    rows[5] = {"question": "q5"}
    rows[9] = {"question": "q9", "answer": "\\"}
    path = _jsonl(tmp_path / "s.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="rljax.tasks"):
        task = _task(path, on_bad_row="skip")
    assert task.stats()["data_skipped_rows"] == 3
    kept = {e.meta["row"] for e in task._data.train + task._data.held_out}
    assert kept == set(range(30)) - {2, 5, 9}
    assert "skipped 3 bad row(s) of 30" in caplog.text
    assert "row 9: field 'answer': unparseable answer" in caplog.text
    assert "skipped=3" in task.describe()
    every_bad = _jsonl(tmp_path / "all.jsonl",
                       [{"question": "", "answer": "1"}] * 3)
    with pytest.raises(ValueError, match=r"no usable rows \(of 3\)"):
        _task(every_bad, on_bad_row="skip")


# --- partition and order ----------------------------------------------------------------


def test_held_out_rows_follow_the_prompt_hash(data):
    task = _task(data, scorer="exact")
    d = task._data
    assert len(d.train) + len(d.held_out) == 40
    assert d.held_out and d.train
    question = {e.meta["row"]: f"What is {e.meta['row']} + {e.meta['row']}?"
                for e in d.train + d.held_out}
    for example in d.held_out:
        assert tasks.is_eval_prompt("dataset", question[example.meta["row"]], 0.1)
    for example in d.train:
        assert not tasks.is_eval_prompt("dataset", question[example.meta["row"]],
                                        0.1)
    # The split is a property of the question, not of the seed or template.
    other = _task(data, scorer="exact", seed=7, template="Q: {prompt}")
    assert ({e.meta["row"] for e in other._data.held_out}
            == {e.meta["row"] for e in d.held_out})
    # Train streams never reach a held-out row, in any epoch.
    held = {e.meta["row"] for e in d.held_out}
    assert not {task.train_example(i).meta["row"] for i in range(200)} & held


def test_train_order_is_seeded_pure_and_covers_each_epoch(data):
    a, b, c = (_task(data, scorer="exact", seed=s) for s in (3, 3, 4))
    n = len(a._data.train)
    forward = [a.train_example(i) for i in range(3 * n)]
    backward = [b.train_example(i) for i in reversed(range(3 * n))][::-1]
    assert forward == backward  # A pure function of (seed, index).
    for epoch in range(3):
        rows = [e.meta["row"] for e in forward[epoch * n:(epoch + 1) * n]]
        assert sorted(rows) == sorted(e.meta["row"] for e in a._data.train)
    assert forward[:n] != forward[n:2 * n]  # Each epoch is reshuffled.
    assert forward[:n] != [c.train_example(i) for i in range(n)]
    stream = a.iter_train(start=n - 1)
    assert [next(stream) for _ in range(3)] == forward[n - 1:n + 2]
    with pytest.raises(ValueError, match="index must be an int >= 0"):
        a.train_example(-1)


def test_eval_split_is_seeded_prefix_stable_and_bounded(data):
    task = _task(data, scorer="exact")
    size = len(task._data.held_out)
    assert task.eval_split(size)[:2] == task.eval_split(2)
    assert task.eval_split(0) == []
    with pytest.raises(ValueError, match=rf"eval split of {size + 1} asked for, "
                                         rf"but only {size} distinct prompts"):
        task.eval_split(size + 1)


# --- messages -------------------------------------------------------------------------


def test_template_system_prompt_and_few_shot(data):
    task = _task(data, scorer="exact", system_prompt="Be brief.", few_shot=2,
                 few_shot_field="solution",
                 template="Problem ({level}): {prompt} {{no field}}")
    example = task.train_example(0)
    row = example.meta["row"]
    assert example.prompt == (f"Problem ({row % 3}): What is {row} + {row}? "
                              f"{{no field}}")
    messages = task.messages(example)
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"] == "Be brief."
    demos = task._data.demos
    assert messages[2]["content"] == demos[0].meta["reply"]
    assert demos[0].meta["reply"].endswith(f"#### {demos[0].answer}")
    # Demonstrations never appear as training prompts.
    n = len(task._data.train)
    demo_rows = {d.meta["row"] for d in demos}
    assert not {task.train_example(i).meta["row"] for i in range(n)} & demo_rows
    assert len({task.train_example(i).meta["row"] for i in range(n)}) == n
    plain = _task(data, scorer="exact")
    assert plain.messages(plain.train_example(0)) == [
        {"role": "user", "content": plain.train_example(0).prompt}]


# --- rewards --------------------------------------------------------------------------


def _one(tmp_path, answer, **kwargs):
    rows = [{"question": f"q{i}", "answer": answer} for i in range(20)]
    task = _task(_jsonl(tmp_path / "one.jsonl", rows), **kwargs)
    return task, task.train_example(0)


@pytest.mark.parametrize("gold, completion, expected", [
    ("72", "She has 72 apples.", 1.0),
    ("72", "72 ... wait, 70", 0.0),
    ("1000", "\\boxed{1,000}", 1.0),
    ("0.5", "The answer is $\\frac{1}{2}$", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("x^2+1", "\\boxed{1 + x^2}", 1.0),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", 1.0),
    ("3", "\\boxed{4}", 0.0),
    ("3", "", 0.0),
])
def test_math_scorer(tmp_path, gold, completion, expected):
    task, example = _one(tmp_path, gold)
    assert task.reward(completion, example) == expected


@pytest.mark.parametrize("mode, completion, expected", [
    ("answer_tag", "think... <answer>1/2</answer>", 1.0),
    ("answer_tag", "0.5 but no tags", 0.0),
    ("boxed", "\\boxed{\\frac{1}{2}} and then 7", 1.0),
    ("last_number", "1/2 is 0.5", 1.0),
    ("last_number", "0.5 then 3", 0.0),
])
def test_math_scorer_after_extraction(tmp_path, mode, completion, expected):
    task, example = _one(tmp_path, "0.5", extract=mode)
    assert task.reward(completion, example) == expected


def test_exact_and_regex_scorers(tmp_path):
    task, example = _one(tmp_path, "Paris", scorer="exact", extract="answer_tag")
    assert task.reward("<answer> Paris </answer>", example) == 1.0
    assert task.reward("<answer>paris</answer>", example) == 0.0
    assert task.reward("Paris", example) == 0.0  # Nothing extracted.
    task, example = _one(tmp_path, r"(?i)paris(, france)?", scorer="regex")
    assert task.reward(" PARIS, France ", example) == 1.0
    assert task.reward("Paris is the capital", example) == 0.0  # fullmatch


def test_module_function_scorer_gets_the_extracted_answer(tmp_path, monkeypatch):
    (tmp_path / "my_scorer.py").write_text(textwrap.dedent("""
        def length_ratio(answer, example):
            return min(len(answer), len(example.answer)) / len(example.answer)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    task, example = _one(tmp_path, "abcd", scorer="my_scorer:length_ratio",
                         extract="boxed")
    assert task.reward("so \\boxed{ab} is it", example) == 0.5
    assert task.reward("no box", example) == 0.0
    assert "my_scorer:length_ratio(answer, example)" in task.describe()
    with pytest.raises(ValueError, match="cannot import module"):
        _one(tmp_path, "a", scorer="no_such_module_xyz:fn")


def test_answer_after_cuts_gsm8k_style_golds(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
            for i in range(20)]
    task = _task(_jsonl(tmp_path / "g.jsonl", rows), answer_after="####")
    example = task.train_example(0)
    assert example.answer == str(int(example.prompt[1:]) + 1)
    assert task.reward(f"The answer is {example.answer}", example) == 1.0


def test_describe_config_and_stats(data):
    task = _task(data, scorer="exact")
    text = task.describe()
    assert text.startswith("dataset(") and "reward: " in text and "1.0" in text
    assert "sha256=" in text and "rows=40" in text
    assert type(task)(**task.config()) == task
    assert task.stats() == {"data_skipped_rows": 0, "reward_timeouts": 0,
                            "reward_errors": 0}


# --- the shipped example ---------------------------------------------------------------


def test_example_file_is_the_generators_output_and_loads(tmp_path):
    generator = runpy.run_path(str(EXAMPLE.with_name("generate.py")))
    rows = generator["generate"](300, 0)
    assert EXAMPLE.read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    assert len({r["question"] for r in rows}) == 300
    for row in rows:  # The worked solution ends in the answer, GSM8K-style.
        assert row["solution"].endswith(f"#### {row['answer']}")
    task = _task(str(EXAMPLE))  # scorer="math": every gold parses.
    assert task.stats()["data_skipped_rows"] == 0
    example = task.eval_split(1)[0]
    assert task.reward(f"... so the answer is {example.answer}.", example) == 1.0
    assert task.reward(f"{int(example.answer) + 1}", example) == 0.0
    assert isinstance(task, dataset_lib.DatasetTask)
