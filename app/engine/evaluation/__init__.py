"""Evaluation beyond perplexity: multiple-choice benchmark tasks scored as llama.cpp's
`llama-perplexity` scores them (HellaSwag, WinoGrande, its binary multiple-choice format, and a
JSONL form users write), and prompt suites scored by the reward functions.

  tasks.py     reading the task files (HellaSwag text, WinoGrande CSV, llama.cpp's binary
               multiple choice, JSONL), each task's texts and gold answer, errors with the line
  scoring.py   one forward per pack of tasks, each task's choices sharing its prefix's tokens
               (a tree mask), the log-probs of each choice's tokens, llama.cpp's choice rules
  suites.py    prompt suites: generation scored by the GRPO reward functions
  runner.py    task specs (`hellaswag:FILE`, ...), one model with its adapters over the tasks,
               the results table and per-task records

Layer: between runs (which queues evaluations) and training (whose reward functions score the
suites); imports training, data, model, text, runtime and errors only.
"""

# What a task spec may name (light: the CLI's parser reads them without loading the engine)
KINDS = ("hellaswag", "winogrande", "mc", "jsonl", "suite", "ppl")
SPEC_HELP = ("hellaswag:FILE, winogrande:FILE, mc:FILE (llama.cpp's binary multiple choice), "
             "FILE.jsonl or jsonl:FILE (multiple choice as JSONL), suite:FILE (a prompt suite), "
             "ppl:FILE (perplexity of a text)")
