"""Engine-agnostic context core: wire rules, token provenance, the event compiler and its program.

Modules (import them directly; this package re-exports nothing, so importing ``program`` stays light):

- ``rules``: ``parse_rules(drop_message, reposition, n_messages) -> ContextRules``; ``RuleError`` family.
- ``drop_rule``: ``parse_request_rules(drop_message, drop_rule, reposition, messages) -> RequestRules``.
- ``spans`` / ``projection`` / ``thinking``: text, visible-projection and reasoning drops -> token ranges.
- ``provenance``: ``ChatTemplate.render_owned``, ``token_provenance``, ``prompt_provenance``.
- ``byte_offsets``: ``spelled_offsets`` (offsets of the server's own token ids, without encoding again).
- ``compiler``: ``compile_program(token_ids, owners, rules, n_messages)``, ``compile_token_drops``,
  ``append_generated``.
- ``program``: the immutable ``ContextProgram`` with its ``Event`` and ``Transition`` records.
- ``wire``: ``encode_program`` / ``decode_program`` (compact bytes, validated on decode).
- ``request``: ``compile_request`` (rules, then provenance, then compiler, for one chat request).
"""
