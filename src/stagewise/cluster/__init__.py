"""The cluster's parts in one place: where each rank runs (`layout`), network interfaces (`netif`),
the rendezvous store and meeting in it (`store`, `rendezvous`), the cluster-token handshake and
sealing (`auth`), sealed point-to-point links and the message codec (`transport`, `codec`), the
pipeline's ring of links (`links`), and what nodes tell each other (`node_options`, `node_reports`).
Nothing is imported here."""
