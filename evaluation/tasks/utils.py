"""Bring the local benchmark copies (../shared/data/eval, see its PROVENANCE.md) to the fields of
the official lm-eval datasets, so each local task YAML includes the official YAML unchanged and
only swaps the data source. Every function here is a `process_docs` hook: Dataset -> Dataset.
"""
import re

import datasets

LETTERS = "ABCDE"
WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")   # a top-level heading starts a new article


def arc_from_llmfoundry(dataset):
    """MosaicML {query: "Question: ...", choices, gold} -> allenai/ai2_arc fields."""
    def convert(doc):
        labels = list(LETTERS[:len(doc["choices"])])
        return {"question": doc["query"].removeprefix("Question: "),
                "choices": {"text": doc["choices"], "label": labels}, "answerKey": labels[doc["gold"]]}
    return dataset.map(convert, remove_columns=dataset.column_names)


def openbookqa_from_llmfoundry(dataset):
    """MosaicML {query, choices, gold} -> allenai/openbookqa fields (query is the question stem)."""
    def convert(doc):
        labels = list(LETTERS[:len(doc["choices"])])
        return {"question_stem": doc["query"], "choices": {"text": doc["choices"], "label": labels},
                "answerKey": labels[doc["gold"]]}
    return dataset.map(convert, remove_columns=dataset.column_names)


def boolq_label(dataset):
    """The OLMo copy stores `answer` (bool); super_glue/boolq's `label` is 0 (no) / 1 (yes)."""
    return dataset.map(lambda doc: {"label": int(doc["answer"])})


def hellaswag_from_text(dataset):
    """Six lines per item (context, gold label, four endings) -> {query, choices, label}.

    The file's context is `activity_label: ctx_a ctx_b` with the [step]/[title]/... markers already
    removed; lm-eval writes ctx_b capitalized, which we approximate by capitalizing the fragment after
    the last sentence end (ctx_a and ctx_b are not separable in this copy).
    """
    lines = dataset["text"][:]                  # a plain list (a Column reads row by row)
    if len(lines) % 6:
        raise ValueError(f"HellaSwag text copy has {len(lines)} lines, not a multiple of 6")
    items = [lines[i:i + 6] for i in range(0, len(lines), 6)]
    return datasets.Dataset.from_dict({
        "query": [clean(capitalize_last_fragment(item[0])) for item in items],
        "choices": [[clean(ending) for ending in item[2:]] for item in items],
        "label": [item[1].strip() for item in items],
    })


def capitalize_last_fragment(text):
    head, sep, tail = text.rpartition(". ")
    return head + sep + tail[:1].upper() + tail[1:]


def clean(text):
    """lm-eval's HellaSwag text cleanup: strip, drop leftover [markers], collapse double spaces."""
    return re.sub(r"\[.*?\]", "", text.strip()).replace("  ", " ")


def wikitext_pages(dataset):
    """WikiText-2 line file -> one document per article ({page}), like wikitext_document_level."""
    pages = []
    for line in dataset["text"][:]:
        if WIKITEXT_TITLE.match(line):
            pages.append([])
        if pages:                      # blank lines before the first title are dropped
            pages[-1].append(line)
    return datasets.Dataset.from_dict({"page": ["\n".join(lines) + "\n" for lines in pages]})
