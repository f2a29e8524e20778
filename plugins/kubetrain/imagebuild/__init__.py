"""Image build internals behind the build operators.

* ``reference``: image reference and tag parsing;
* ``oci``: a small client for the OCI distribution API (blobs, manifests);
* ``oci_targets``: where its requests may go (known token services, redirects, upload locations);
* ``oci_auth``: its credentials (Basic, Bearer challenges and tokens);
* ``registry_errors``: the errors a registry's answers become;
* ``layer``: deterministic layer tarballs and content hashes of a source tree;
* ``append``: add one code layer to a base image already in the registry;
* ``builders``: the build request and the interface both builders share;
* ``buildah``: daemonless builds on the Airflow worker;
* ``incluster``: the BuildKit builder pod for builds on the cluster;
* ``plan``: decide between no build, a code layer and a full build of the trainer image;
* ``products``: the images kubetrain ships, their names, and their build, check and push;
* ``release``: ``python -m kubetrain.imagebuild.release`` (``make images``);
* ``trainer_image``: the build_trainer_image DAG's task bodies (they use Airflow Variables).

Apart from ``trainer_image`` (and the registry connection in ``release``), nothing here imports
Airflow, so each piece is usable and testable on its own.
"""
