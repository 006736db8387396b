/* checksum.h - CRC-32C (Castagnoli) of a byte range: what snapshots,
 * checkpoints and the ranks' fingerprints carry to name a damaged or
 * differing part. The SSE4.2 instruction where the CPU has it (chosen once),
 * a table otherwise; both give the same value (RFC 3720's polynomial,
 * reflected, initial and final XOR with ~0). */
#ifndef FS_CHECKSUM_H
#define FS_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* The CRC-32C of n bytes at p, continued from crc (0 to start):
 * fs_crc32c(fs_crc32c(0, a, n), b, m) == the CRC of a's bytes then b's. */
uint32_t fs_crc32c(uint32_t crc, const void *p, size_t n);

/* The same through the table only (the reference the tests compare with). */
uint32_t fs_crc32c_table(uint32_t crc, const void *p, size_t n);

#endif
