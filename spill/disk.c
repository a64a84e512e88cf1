/*
 * spill/disk.c - the disk tier's files: one file per spilled buffer in a private
 * directory (mode 0700, files 0600) made with mkdtemp under the configured
 * parent, written with pwrite and read with pread in large pieces, removed on
 * unspill, free and destroy.
 */
#include "runtime/internal.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>


#define DISK_IO_CHUNK ((size_t)64 << 20)

struct dmem__disk {
  char dir[4096];
};

dmem_status_t dmem__disk_create(const char *parent, dmem__disk_t **disk_out) {
  if (!parent || !*parent) parent = getenv("TMPDIR");
  if (!parent || !*parent) parent = "/tmp";
  dmem__disk_t *d = calloc(1, sizeof *d);
  if (!d) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "disk tier allocation failed");
  int n = snprintf(d->dir, sizeof d->dir, "%s/dmem-spill-XXXXXX", parent);
  if (n < 0 || (size_t)n >= sizeof d->dir) {
    free(d);
    return dmem__error(DMEM_ERR_IO, "spill directory path too long: %s", parent);
  }
  if (!mkdtemp(d->dir)) { /* mkdtemp makes it 0700 */
    int e = errno;
    free(d);
    return dmem__error(DMEM_ERR_IO, "mkdtemp(%s/dmem-spill-XXXXXX): %s", parent, strerror(e));
  }
  *disk_out = d;
  return DMEM_OK;
}

static void file_name(const dmem__disk_t *d, uint64_t key, char *out, size_t n) {
  snprintf(out, n, "%s/%016llx", d->dir, (unsigned long long)key);
}

dmem_status_t dmem__disk_write(dmem__disk_t *d, uint64_t key, const void *data, size_t n) {
  char path[4200];
  file_name(d, key, path, sizeof path);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return dmem__error(DMEM_ERR_IO, "open(%s): %s", path, strerror(errno));
  size_t done = 0;
  while (done < n) {
    size_t len = n - done < DISK_IO_CHUNK ? n - done : DISK_IO_CHUNK;
    ssize_t w = pwrite(fd, (const char *)data + done, len, (off_t)done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int e = w < 0 ? errno : ENOSPC;
      close(fd);
      unlink(path);
      return dmem__error(DMEM_ERR_IO, "pwrite(%s, %zu bytes at %zu): %s", path, len, done,
                         strerror(e));
    }
    done += (size_t)w;
  }
  if (close(fd) != 0) {
    int e = errno;
    unlink(path);
    return dmem__error(DMEM_ERR_IO, "close(%s): %s", path, strerror(e));
  }
  return DMEM_OK;
}

dmem_status_t dmem__disk_read(dmem__disk_t *d, uint64_t key, void *data, size_t n) {
  char path[4200];
  file_name(d, key, path, sizeof path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return dmem__error(DMEM_ERR_IO, "open(%s): %s", path, strerror(errno));
  size_t done = 0;
  while (done < n) {
    size_t len = n - done < DISK_IO_CHUNK ? n - done : DISK_IO_CHUNK;
    ssize_t r = pread(fd, (char *)data + done, len, (off_t)done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = r < 0 ? errno : EIO;
      close(fd);
      return dmem__error(DMEM_ERR_IO, "pread(%s, %zu bytes at %zu): %s", path, len, done,
                         r == 0 ? "file too short" : strerror(e));
    }
    done += (size_t)r;
  }
  close(fd);
  return DMEM_OK;
}

void dmem__disk_remove(dmem__disk_t *d, uint64_t key) {
  if (!d) return;
  char path[4200];
  file_name(d, key, path, sizeof path);
  unlink(path);
}

void dmem__disk_destroy(dmem__disk_t *d) {
  if (!d) return;
  /* Files of live buffers are removed at their reclaim; remove any left
   * over, then the directory. */
  DIR *dir = opendir(d->dir);
  if (dir) {
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      char path[4400];
      snprintf(path, sizeof path, "%s/%s", d->dir, e->d_name);
      unlink(path);
    }
    closedir(dir);
  }
  rmdir(d->dir);
  free(d);
}
