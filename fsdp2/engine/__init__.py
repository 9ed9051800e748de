"""The engine: what runs around every forward and backward of a sharded module.

Read the files in the order data flows through them:

- ``module.py``: the methods a sharded module gains (``FSDPModule``; its setters in
  ``module_settings.py``).
- ``state.py``: the hooks around one ``fully_shard`` call's forward and backward, which say
  *when* (a forward starts, a module's backward is done, the backward ends: the root queues
  autograd's callback); at each pre-forward ``changes.py`` takes up what the user changed on the
  module, and ``backward_done.py`` says when a module's backward is done (its inputs' gradients
  are in). ``registry.py`` finds the states of a module tree.
- ``iteration.py``: one root's pass (``IterContext``), which knows groups, not states, and
  decides *what* every collective of an iteration is: which groups to gather now and which to
  prefetch (coalesced or alone), and ``finish_group``, the one place a group is finished with a
  backward (reshard, then reduce or stash), and the end of backward.
- the gather side: ``coalesce.py`` (``Gathers``: a run of small groups in one collective),
  ``param_group.py`` (one call's parameters and their unshard/reshard state machine),
  ``layout.py`` and ``param.py`` (each parameter's place in the group's flat buffers;
  ``chunk.py``: which of its rows this rank holds).
- the gradient side: ``reduce.py`` (a group's reduce-scatter), ``coalesce_reduce.py``
  (``Reductions``: the backward's reduce-scatters, held for coalescing, in flight, reduced),
  ``grads.py`` (a gradient on its way in, and handed to the sharded parameter).
- ``collectives.py``: the one seam to the process group.

The tensors, per group and per rank (``W`` = the shard group's size):

- *sharded parameter*: ``FSDPParam.sharded_param``, the ``DTensor`` the optimizer and the user
  hold; its local tensor is this rank's rows of the parameter, a view of the flat shard buffer.
- *flat shard buffer*: ``FlatLayout.sharded_flat``, 1-D, this rank's padded chunk of every
  parameter back to back; the all-gather's input as it is ([Note: flat layout]).
- *gather output*: 1-D, rank-major (every rank's flat shard, one after another), freed once
  copied out.
- *unsharded buffer*: ``FlatLayout.unsharded_flat``, 1-D, param-major (every parameter whole,
  padded to ``W`` chunks); its storage shrinks to nothing at reshard and grows back at the next
  gather ([Note: freeing unsharded storage]).
- *unsharded parameter*: ``FSDPParam.unsharded_param``, a view of the unsharded buffer in the
  parameter's full shape, registered on the module between unshard and reshard.
- *gradient views*: autograd's ``.grad`` of the unsharded parameters, taken at reduction; the
  reduced shards come back as the sharded parameters' ``.grad``, each a piece of the
  reduce-scatter output with a storage of its own (``param.own_storage``).
- *reduce-scatter input*: ``(W, chunks)``, every trainable parameter's gradient cut rank-major
  (in ``reduce_dtype``); *reduce-scatter output*: 1-D, this rank's reduced chunk of each.
"""
