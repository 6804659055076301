"""What the plugin uses of SGLang's objects, as Protocols: one place to read it.

The scheduler hooks are handed SGLang's own objects (a request, its batch, the scheduler, the
radix tree cache and its tree core, the KV allocator, HiCache's host pool), and so are the
attention backends' shared code, the hot set's construction, the graph hooks and the KV
pool's sizing (the model runner and its KV pool, a forward batch, an attention layer, the
decode graph runner, the KV cache configurator). Each Protocol here stands for one SGLang
class and lists only the attributes and methods the plugin reads, writes or calls on it, with
the types SGLang 0.5.23 gives them (its class is named in the docstring), so a field SGLang
renames or retypes shows up in one place. They are for typing only: nothing here imports
SGLang (nor anything of the plugin outside this package, whose modules name each other's
Protocols under ``TYPE_CHECKING``), and no object is checked against them at run time. The
backends themselves subclass SGLang's backends and name SGLang's classes.

One module per family, each name imported from its module (this package re-exports nothing):

- ``tree``: the radix tree cache, its tree core and nodes, locks, the KV allocator and
  HiCache's host pool;
- ``scheduler``: a request, a batch, the prefill adder and its admission, the scheduler;
- ``server``: the server arguments;
- ``model``: the model runner and its config, the KV and req_to_token pools, a forward batch,
  an attention layer, the decode graph runner, the KV cache configurator, and the layers and
  ops torch_cpu's C forwards stand in for.
"""
