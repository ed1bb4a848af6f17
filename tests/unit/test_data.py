"""Prompt loading (JSONL, Parquet), the prompt source (shuffle, epochs, returns, resume), tasks, CLI."""

from __future__ import annotations

import collections
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verst.config import DataConfig
from verst.data import (
    DATA_INDEX_KEY,
    TASKS,
    DataError,
    PromptKeys,
    PromptSource,
    load_prompts,
    load_prompts_from_config,
    make_splits,
)
from verst.types import Sample

REPO = Path(__file__).resolve().parents[2]
CUSTOM = PromptKeys(prompt="question", label="answer", metadata="info", tools="functions")
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(samples: list[Sample]) -> list:
    return [s.prompt for s in samples]


# ---- loading -----------------------------------------------------------------------------


def test_jsonl_custom_keys_text_and_chat_prompts(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question": "capital of France?", "answer": "Paris", "info": {"src": "geo"}, "extra": 1},
            {"question": chat, "answer": 4, "functions": TOOLS},
        ],
    )
    first, second = load_prompts(path, CUSTOM)
    assert (first.prompt, first.label, first.metadata) == ("capital of France?", "Paris", {"src": "geo"})
    assert (second.prompt, second.label, second.metadata) == (chat, 4, {"tools": TOOLS})
    assert first.tokens == [] and first.response == ""  # the chat template is applied later, at the edge


def test_jsonl_skips_blank_lines_and_unlabelled_data(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    prompts = load_prompts(path, PromptKeys(label=None))
    assert texts(prompts) == ["a", "b"] and all(p.label is None for p in prompts)


def test_parquet_custom_keys_with_struct_and_json_string_columns(tmp_path):
    table = pa.table(
        {
            "question": [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "3+4="}]],
            "answer": ["3", "7"],
            "info": [json.dumps({"level": 1}), None],
            "functions": [None, json.dumps(TOOLS)],
            "ignored": [1, 2],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    first, second = load_prompts(tmp_path / "p.parquet", CUSTOM)
    assert first.prompt == [{"role": "user", "content": "1+2="}] and first.label == "3"
    assert first.metadata == {"level": 1}
    assert second.metadata == {"tools": TOOLS} and second.label == "7"


def test_parquet_struct_metadata_and_forced_format(tmp_path):
    table = pa.table({"prompt": ["x"], "label": ["y"], "metadata": [{"k": 5}]})
    pq.write_table(table, tmp_path / "data.bin")
    (prompt,) = load_prompts(tmp_path / "data.bin", fmt="parquet")
    assert prompt.metadata == {"k": 5}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"text": "hi", "label": "x"}, "missing prompt key 'prompt'"),
        ({"prompt": 7, "label": "x"}, "key 'prompt' must be a string"),
        ({"prompt": [{"content": "hi"}], "label": "x"}, "message 0 must be an object with 'role'"),
        ({"prompt": "hi"}, "label key 'label' is missing"),
        ({"prompt": "hi", "label": None}, "label key 'label' is null"),
        ({"prompt": "hi", "label": "x", "metadata": [1]}, "key 'metadata' must be a dict, got list"),
        ({"prompt": "hi", "label": "x", "tools": "{not json"}, "key 'tools' is a string that is not JSON"),
        ({"prompt": "hi", "label": "x", "metadata": {DATA_INDEX_KEY: 1}}, "reserved"),
        (["prompt"], "a row must be an object"),
    ],
)
def test_bad_jsonl_row_names_file_line_and_key(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "label": "1"}, row])
    with pytest.raises(DataError, match=re.escape(message)) as info:
        load_prompts(path)
    assert f"{path} line 2" in str(info.value)


def test_bad_json_line_and_empty_or_missing_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "label": "b"}\n{"prompt": \n')
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))} line 2: not valid JSON"):
        load_prompts(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no prompts"):
        load_prompts(empty)
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "p.csv").write_text("x")
    with pytest.raises(DataError, match="set data.format"):
        load_prompts(tmp_path / "p.csv")


def test_bad_parquet_rows_name_file_row_and_key(tmp_path):
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), tmp_path / "nokey.parquet")
    with pytest.raises(DataError, match="missing prompt key 'prompt'"):
        load_prompts(tmp_path / "nokey.parquet")
    pq.write_table(pa.table({"prompt": ["a", None], "label": ["b", "c"]}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"null\.parquet row 1: key 'prompt' must be a string"):
        load_prompts(tmp_path / "null.parquet")


def test_load_from_config_train_and_test(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"q": "a", "a": "1"}, {"q": "b", "a": "2"}])
    cfg = DataConfig(train_path=str(tmp_path / "train.jsonl"), test_path=None, prompt_key="q", label_key="a")
    assert [p.label for p in load_prompts_from_config(cfg)] == ["1", "2"]
    with pytest.raises(DataError, match="data.test_path is not set"):
        load_prompts_from_config(cfg, "test")


# ---- the prompt source -------------------------------------------------------------------


def make_source(n: int = 10, **kwargs) -> PromptSource:
    return PromptSource([Sample(prompt=f"p{i}", label=str(i)) for i in range(n)], **kwargs)


def test_seeded_shuffle_is_deterministic_and_seed_dependent():
    a, b, c = make_source(seed=1), make_source(seed=1), make_source(seed=2)
    first = texts(a.next_prompts(10))
    assert first == texts(b.next_prompts(10))
    assert first != texts(c.next_prompts(10))
    assert sorted(first) == sorted(f"p{i}" for i in range(10))
    assert texts(make_source(shuffle=False).next_prompts(4)) == ["p0", "p1", "p2", "p3"]


def test_epochs_wrap_around_and_reshuffle():
    source = make_source(n=6, seed=3)
    assert source.epoch == 0
    epoch0 = texts(source.next_prompts(4))
    assert source.epoch == 0
    epoch0 += texts(source.next_prompts(2))
    assert source.epoch == 1
    epoch1 = texts(source.next_prompts(6))
    assert source.epoch == 2
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"p{i}" for i in range(6))
    assert epoch0 != epoch1
    # a request larger than the data spans epochs
    assert len(source.next_prompts(13)) == 13 and source.epoch == 4


def test_served_prompts_are_fresh_copies_with_their_row():
    source = make_source(n=3, shuffle=False)
    first = source.next_prompts(1)[0]
    first.metadata["scratch"] = True
    first.response = "changed"
    source.next_prompts(2)
    again = source.next_prompts(1)[0]
    assert again.metadata == {DATA_INDEX_KEY: 0} and again.response == "" and again.label == "0"


def test_next_groups_numbering_increases_across_calls():
    source = make_source(n=5, seed=0)
    groups = source.next_groups(2, 3) + source.next_groups(3, 3)
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3, 4]
    assert [s.index for g in groups for s in g] == list(range(15))
    assert all(len({s.prompt for s in g}) == 1 and all(s.group_index == g[0].group_index for s in g) for g in groups)
    with pytest.raises(DataError, match="n_samples_per_prompt must be >= 1, got 0"):
        source.next_groups(1, 0)


def test_returned_prompts_are_served_again_first_once_per_group():
    source = make_source(n=8, seed=5)
    groups = source.next_groups(3, 4)
    reference = make_source(n=8, seed=5)
    reference.next_prompts(3)
    # two whole groups come back (all their samples), in this order
    source.return_prompts(groups[2] + groups[0])
    served = source.next_groups(4, 2)
    assert [g[0].prompt for g in served[:2]] == [groups[2][0].prompt, groups[0][0].prompt]
    assert served[2][0].prompt == reference.next_prompts(1)[0].prompt  # then the order resumes
    assert served[0][0].group_index == 3  # a served-again prompt gets a new group number


def test_return_prompts_rejects_samples_from_elsewhere():
    source = make_source(n=3)
    with pytest.raises(DataError, match=r"metadata\['data_index'\] = None"):
        source.return_prompts([Sample(prompt="x")])
    with pytest.raises(DataError, match="= 7, not a row of this source"):
        source.return_prompts([Sample(prompt="x", metadata={DATA_INDEX_KEY: 7})])


def test_resumed_position_continues_the_uninterrupted_sequence():
    def run(source: PromptSource, steps: range) -> list:
        out = []
        for step in steps:
            groups = source.next_groups(3, 2)
            out += [(s.prompt, s.group_index, s.index) for g in groups for s in g]
            if step % 2 == 0:
                source.return_prompts(groups[-1])  # the last group is unused and goes back
        return out

    uninterrupted = run(make_source(n=7, seed=11), range(8))
    first = make_source(n=7, seed=11)
    before = run(first, range(5))
    state = json.loads(json.dumps(first.state_dict()))  # the position survives JSON
    assert state["returned"], "the saved position should hold a returned prompt"
    resumed = make_source(n=7, seed=11)
    resumed.load_state_dict(state)
    assert resumed.epoch == first.epoch
    assert before + run(resumed, range(5, 8)) == uninterrupted


def test_load_state_rejects_a_different_dataset_or_seed():
    state = make_source(n=5, seed=1).state_dict()
    with pytest.raises(DataError, match="n_prompts = 5, but this source has 6"):
        make_source(n=6, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed = 1, but this source has 2"):
        make_source(n=5, seed=2).load_state_dict(state)


def test_source_from_config(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "label": str(i)} for i in range(4)])
    cfg = DataConfig(train_path=str(tmp_path / "t.jsonl"), test_path=str(tmp_path / "t.jsonl"), shuffle=False)
    source = PromptSource.from_config(cfg, "test")
    assert len(source) == 4 and texts(source.next_prompts(2)) == ["q0", "q1"]


# ---- procedural tasks --------------------------------------------------------------------


def test_addition_prompts_and_labels():
    train, test = make_splits("addition", 300, 50, seed=1)
    for p in train + test:
        a, b = re.fullmatch(r"(\d\d)\+(\d\d)=", p.text).groups()
        assert p.label == str(int(a) + int(b))
        assert p.to_row()["prompt"] == [{"role": "user", "content": p.text}]


def test_reversal_and_multistep_labels():
    train, _ = make_splits("reversal", 100, 0, seed=2)
    for p in train:
        word = re.fullmatch(r"reverse ([a-z]{3,6})=", p.text).group(1)
        assert p.label == word[::-1]
    train, _ = make_splits("multistep", 200, 0, seed=2)
    for p in train:
        expression = p.metadata["expression"]
        assert re.fullmatch(r"[\d+\-*()]+", expression) and p.text == f"{expression}="
        assert p.label == str(eval(expression, {"__builtins__": {}}))  # digits and + - * ( ) only
    assert any("(" in p.metadata["expression"] for p in train)


def test_chain_addition_labels_are_running_sums_with_a_long_tail_of_terms():
    train, _ = make_splits("chain_addition", 2000, 0, seed=2)
    counts = collections.Counter()
    for p in train:
        terms = [int(t) for t in re.fullmatch(r"(\d\d(?:\+\d\d)+)=", p.text).group(1).split("+")]
        assert [int(x) for x in p.label.split(",")] == list(itertools.accumulate(terms))[1:]
        counts[len(terms)] += 1
    assert set(counts) == {2, 3, 4, 5, 8, 9, 10, 11, 12}  # CHAIN_TERMS: 2, 3-5 or 8-12 terms
    assert 0.70 < counts[2] / len(train) < 0.85  # 80% drawn, fewer after duplicate 2-term prompts are skipped
    assert 0.02 < sum(counts[k] for k in range(8, 13)) / len(train) < 0.08


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_distinct_and_deterministic(task):
    n_train = 100 if task == "small_addition" else 500  # small_addition has 225 prompts in all
    train, test = make_splits(task, n_train, 100, seed=3)
    train_texts, test_texts = {p.text for p in train}, {p.text for p in test}
    assert len(train_texts) == n_train and len(test_texts) == 100
    assert not train_texts & test_texts
    assert make_splits(task, n_train, 100, seed=3) == (train, test)
    assert make_splits(task, 50, 100, seed=3)[1] == test  # the test split does not depend on n_train
    assert make_splits(task, n_train, 100, seed=4)[1] != test


def test_task_errors():
    with pytest.raises(DataError, match=r"unknown task 'division'; known tasks: \['addition'"):
        make_splits("division", 1, 1)
    with pytest.raises(DataError, match="has 8100 distinct prompts; asked for 8000 train \\+ 200 test"):
        make_splits("addition", 8000, 200)


# ---- the CLI -----------------------------------------------------------------------------


def test_cli_writes_loadable_splits_without_torch(tmp_path):
    code = (
        "import sys; from verst.cli.main import main; "
        f"rc = main(['data', 'make', 'addition', '--n', '40', '--n-test', '10', '--out', {str(tmp_path)!r}, '--seed', '7']); "
        "assert 'torch' not in sys.modules, 'verst data imported torch'; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'train.jsonl'}: 40 addition prompts" in result.stdout
    assert f"{tmp_path / 'test.jsonl'}: 10 addition prompts" in result.stdout
    train, test = load_prompts(tmp_path / "train.jsonl"), load_prompts(tmp_path / "test.jsonl")
    assert len(train) == 40 and len(test) == 10
    assert train[0].metadata == {"task": "addition"}
    assert not {p.prompt[0]["content"] for p in train} & {p.prompt[0]["content"] for p in test}


def test_cli_reports_an_impossible_request(tmp_path, capsys):
    from verst.cli.data import main

    assert main(["make", "addition", "--n", "9000", "--out", str(tmp_path)]) == 2
    assert "8100 distinct prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["make", "nonsense", "--n", "1", "--out", str(tmp_path)])


def test_small_addition_covers_all_sums_of_two_numbers_up_to_15():
    train, test = make_splits("small_addition", 165, 60, seed=0)
    pairs = set()
    for problem in train + test:
        a, b = map(int, problem.text.removeprefix("What is ").split("?")[0].split(" + "))
        assert problem.label == str(a + b) and 1 <= a <= 15 and 1 <= b <= 15
        pairs.add((a, b))
    assert len(pairs) == 225  # every pair once: train and test share no prompt
    with pytest.raises(DataError, match="225 distinct prompts"):
        make_splits("small_addition", 200, 26)
