/* Counts the guest instructions a program executes under qemu user mode: a
 * TCG plugin (QEMU's plugin API version 1, qemu 7.2 and later), for the
 * instruction counts per kernel path in docs/design.md §4.1. Instruction
 * counts under emulation, not speed.
 *
 *   gcc -O2 -shared -fPIC tools/qemu_insn_count.c -o /tmp/libinsncount.so
 *   qemu-aarch64 -cpu cortex-a53 -plugin /tmp/libinsncount.so -d plugin \
 *     build-phone/zl/runner/zl_step_check --export-dir build-phone/export --out /tmp/step.safetensors
 *   -> "insns: 37655371" on stderr at exit
 *
 * Debian's qemu-user runs plugins but ships neither qemu-plugin.h nor the
 * example plugins, so the few API calls used are declared here. The counter
 * is bumped inline per translated block, without atomics: exact for a
 * single-threaded guest (zl_step_check runs one thread), inexact otherwise. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*tb_trans_cb)(qemu_plugin_id_t id, struct qemu_plugin_tb* tb);
typedef void (*udata_cb)(qemu_plugin_id_t id, void* userdata);

size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb* tb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb* tb, enum qemu_plugin_op op, void* ptr,
                                              uint64_t imm);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb cb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, udata_cb cb, void* userdata);
void qemu_plugin_outs(const char* string);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

static uint64_t executed;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb* tb) {
  (void)id;
  qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed, qemu_plugin_tb_n_insns(tb));
}

static void report(qemu_plugin_id_t id, void* userdata) {
  (void)id;
  (void)userdata;
  char line[64];
  snprintf(line, sizeof(line), "insns: %llu\n", (unsigned long long)executed);
  qemu_plugin_outs(line);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t* info,
                                                               int argc, char** argv) {
  (void)info;
  (void)argc;
  (void)argv;
  qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
  qemu_plugin_register_atexit_cb(id, report, NULL);
  return 0;
}
