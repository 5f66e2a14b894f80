"""The ops behind Buffer, one module per mode: ``layout`` (get_dispatch_layout),
``intranode`` (dispatch and combine inside one NVL domain), ``low_latency``
(decoding: dispatch and combine without host sync). ``handle`` is what
a dispatch leaves for its cached dispatch and its combine; ``streams`` runs an
op on the communication stream; ``context`` is what the ops read of a Buffer."""
