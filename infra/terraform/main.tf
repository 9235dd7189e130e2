# The platform's Kafka topics for a real cluster. The topic map is not repeated here: it is read from
# topics.json, which `python -m schemas.topics > infra/terraform/topics.json` exports from schemas/topics.py
# (a contract test fails when the two drift apart).
terraform {
  required_version = ">= 1.5"
  required_providers {
    kafka = {
      source  = "Mongey/kafka"
      version = "~> 0.7"
    }
  }
}

variable "bootstrap_servers" {
  type        = list(string)
  description = "Brokers of the target cluster."
}

variable "namespace" {
  type        = string
  default     = ""
  description = "Prefix of every topic name (KNS_KAFKA__NAMESPACE of the services)."
}

variable "replication_factor" {
  type    = number
  default = 3
}

variable "min_insync_replicas" {
  type    = number
  default = 2
}

provider "kafka" {
  bootstrap_servers = var.bootstrap_servers
  tls_enabled       = false
}

locals {
  topics = { for t in jsondecode(file("${path.module}/topics.json")).topics : t.name => t }
}

resource "kafka_topic" "platform" {
  for_each           = local.topics
  name               = var.namespace == "" ? each.key : "${var.namespace}.${each.key}"
  partitions         = each.value.partitions
  replication_factor = var.replication_factor
  config = merge(each.value.configs, {
    "min.insync.replicas" = tostring(var.min_insync_replicas)
  })
}

output "topics" {
  value = [for t in kafka_topic.platform : t.name]
}
