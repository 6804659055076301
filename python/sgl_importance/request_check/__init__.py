"""Generate requests the scheduler cannot serve safely are refused before it sees them.

SGLang 0.5.23 checks many request fields, but some values it lets through end
the scheduler process, and with it the server, for every tenant (seen on
``torch_cpu``, stock SGLang as well): ``top_logprobs_num`` above the vocabulary
(``topk`` out of range in the logprob processor), or given as a list for one
prompt (as is ``logprob_start_len``); a ``stop_token_ids`` id outside the
vocabulary with ``min_new_tokens`` (an out-of-range scatter in the min-tokens
penalizer); ``top_k`` above 2^31 - 1 (an int32 overflow building the batch's
sampling tensors); ``positional_embed_overrides`` in a JSON body; a custom
metric label the tokenizer's series were not declared with. Others are legal but
unbounded: ``n`` and batch size multiply the work one request asks for, top log
probabilities are copied to Python lists per position, a repetition penalty
near 0 overflows the logits, and a stop regex runs in the scheduler on every
decode step with Python's backtracking engine, where ``(a+)+b`` over a few dozen
characters takes seconds and doubles with each one. Malformed shapes (a
``sampling_params`` list that does not match the batch, a key SGLang's
``SamplingParams`` or ``SessionParams`` does not take, an invalid stop regex, a
chat template keyword that is the template call's own) raise something other
than ``ValueError`` and become 500s.

Each check raises the package's own error, :class:`fields.InvalidRequestError`
(:class:`fields.InvalidFieldError` where one field is at fault), which SGLang
answers with a 400 and the endpoint's usual body. The message names the field as the caller
spelled it (``top_logprobs`` on chat, ``logprobs`` on completions,
``sampling_params.top_k`` on ``/generate``), its value and what is allowed.
docs/requests.md lists each check with its limit and what it replaced.

Every request check lives here, one file a job:

- ``hook.py``: the AROUND-hook body (``checked_generate``) and the server's limits;
- ``generate.py``: :func:`check_generate_request`, every field of one request;
- ``sampling.py``: one prompt's sampling parameters;
- ``stop.py``: stop strings and stop regexes, bounded by their cost per step;
- ``prompt.py``: prompts the model cannot read (empty, out-of-vocabulary ids) and a
  request's own hot-set parameters, in the tokenizer manager;
- ``openai.py``: the OpenAI endpoints' model name, the body shapes SGLang's request
  model would fail on, and the endpoint's names for fields;
- ``chat_template.py``: a chat request's ``chat_template_kwargs`` (called by ``openai.py``);
- ``fields.py``: the limits, the errors and the caller's names for fields.
- ``control.py``: SGLang's control endpoints, a 400 where its scheduler would have died.

The checks read the server's settings from the HTTP process's runtime (``runtime.py``),
handed in by ``plugin.py``.
"""
