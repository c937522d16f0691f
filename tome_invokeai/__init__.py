"""ToMe in InvokeAI: a node pack of denoise nodes with Token Merging (docs/INVOKEAI.md).

InvokeAI's node loader (``invokeai/app/invocations/load_custom_nodes.py``) imports each folder under
``$INVOKEAI_ROOT/nodes``; this repository, cloned or linked there, is one (its root ``__init__.py`` imports this
package where InvokeAI is the host). ``job`` patches a job's model and needs no InvokeAI; ``invocations`` registers
the nodes.
"""
