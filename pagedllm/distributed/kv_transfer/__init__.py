"""KV transfer between engine instances (prefill/decode disaggregation, vLLM v1's KV connectors).

config.py (KVTransferConfig: --kv-transfer-config), base.py (KVConnectorBase: the scheduler and
worker sides), zmq_transport.py (the producer's ZMQ server and the consumer's pull, over TCP or
shared memory), zmq_connector.py (ZmqConnector, the connector that uses it), factory.py.
"""
