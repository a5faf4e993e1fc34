"""The cluster's parts in one place: where each rank runs (`layout`), network interfaces (`netif`),
the rendezvous store and meeting in it (`store`, `rendezvous`), the cluster-token handshake and
sealing (`auth`), sealed point-to-point links and the message codec (`transport`, `codec`), the
pipeline's ring of links (`links`), what nodes tell each other (`node_options`, `node_reports`), and
the nodes a Ray cluster starts (`ray_nodes`, its helper process `ray_helper`).
Nothing is imported here."""
