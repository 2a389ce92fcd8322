# A base of a few MB with a shell and coreutils (busybox, a static binary, from the build context): the build
# routes' tests build route.dockerfile on it, where the training image would take minutes per route.
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
CMD ["/bin/sh"]
