"""fleetd: long-lived outbound WebSocket streams, leased through DynamoDB conditional writes."""

__version__ = "0.1.0"
